"""``paratron plan``: rank the parallel layouts of a model on a cluster; write the best as a config.

Usage::

    paratron plan --config configs/default.toml --gpu cpu --nodes 1 --gpus-per-node 4 --output plan.toml
    paratron plan --hf-config config.json --gpu h100 --nodes 4 --gpus-per-node 8 \\
        --global-batch-size 512 --seq-length 4096 --explain
    paratron plan --calibrate --gpus-per-node 4          # measure this CPU for --gpu cpu

``--gpu cpu`` without a calibration file measures this CPU first (as ``--calibrate``) and writes
the file. On a terminal, progress bars count the layouts bounded, simulated and pruned (``--quiet``:
none; never in a log).
``paratron train --config plan.toml --nproc-per-node G`` runs the written plan as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from paratron.config import Config, ConfigError
from paratron.rules import build_config

from .verify import verify
from paratron.checkpoint.hf import hf_config_to_model
from paratron.data.tokenizer import from_file
from paratron.planner import report
from paratron.planner.calibrate import calibrate, load
from paratron.planner.estimate import Problem
from paratron.planner.hardware import Cluster, device
from paratron.planner.search import plan
from paratron.planner.shape import Shape

DEFAULT_CALIBRATION = "runs/cpu-calibration.json"
GPT2_VOCAB = 50257


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help="TOML config of the model (its parallel/batch fields are replaced)")
    src.add_argument("--hf-config", help="a Hugging Face config.json (Llama, GPT-2, Mixtral, Qwen2-MoE, Qwen3, Qwen3-MoE)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of the base config (repeatable)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default 8; cpu: 4)")
    p.add_argument("--gpu", default="h100", help="device type: h100 (default), h200, a100 or cpu")
    p.add_argument("--intra-bw-gbs", type=float, default=None, help="GB/s per device inside a node")
    p.add_argument("--inter-bw-gbs", type=float, default=None, help="GB/s per device across nodes")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory, GB (1e9 bytes)")
    p.add_argument("--global-batch-size", type=int, default=None, help="default: the config's")
    p.add_argument("--seq-length", type=int, default=None, help="default: the config's")
    p.add_argument("--vocab-size", type=int, default=None, help="when neither the config nor its tokenizer says")
    p.add_argument("--top-k", type=int, default=5, help="layouts printed, best first (default 5)")
    p.add_argument("--output", help="write the best plan as a TOML config here")
    p.add_argument("--explain", nargs="?", type=int, const=1, default=None, metavar="RANK",
                   help="show the cost breakdown of plan RANK (default 1)")
    p.add_argument("--verify", nargs="?", type=int, const=1, default=None, metavar="N",
                   help="dry-run the top N plans (default 1) on this CPU (paratron dryrun) and print the "
                        "measured bytes beside the planner's")
    p.add_argument("--calibrate", action="store_true", help="measure this CPU (GEMM rate, gloo) and exit")
    p.add_argument("--calibration", default=DEFAULT_CALIBRATION,
                   help="CPU calibration file (read; measured and written first when missing)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def base_config(args: argparse.Namespace) -> Config:
    """The model's config, from --config or --hf-config, with vocab_size filled in."""
    if args.hf_config:
        path = Path(args.hf_config)
        if not path.is_file():
            raise ConfigError(f"--hf-config={str(path)!r} does not exist")
        cfg = build_config(None, args.overrides)
        cfg.model = hf_config_to_model(json.loads(path.read_text()), str(path))
    else:
        cfg = build_config(args.config, args.overrides)
    if args.vocab_size:
        cfg.model.vocab_size = args.vocab_size
    return cfg


def model_with_vocab(cfg: Config) -> object:
    """The model config with ``vocab_size`` set (from the tokenizer the config names if need be)."""
    m = cfg.model
    if m.vocab_size is not None:
        return m
    if cfg.data.tokenizer_type == "ByteLevelBPE":
        return dataclasses.replace(m, vocab_size=cfg.data.tokenizer_vocab_size)
    if cfg.data.tokenizer_type == "GPT2BPETokenizer":
        return dataclasses.replace(m, vocab_size=GPT2_VOCAB)
    if cfg.data.tokenizer_model and Path(cfg.data.tokenizer_model).is_file():
        return dataclasses.replace(m, vocab_size=from_file(cfg.data.tokenizer_model).vocab_size)
    raise ConfigError("model.vocab_size is unset and data.tokenizer_model names no tokenizer file to read it "
                      "from: pass --vocab-size")


def problem(args: argparse.Namespace, cfg: Config):
    """The :class:`~paratron.planner.estimate.Problem` of these arguments."""
    gpn = (4 if args.gpu == "cpu" else 8) if args.gpus_per_node is None else args.gpus_per_node
    for name, v in (("--nodes", args.nodes), ("--gpus-per-node", gpn), ("--top-k", args.top_k)):
        if v < 1:
            raise ConfigError(f"{name}={v} must be a positive integer (>= 1)")
    cal = None
    if args.gpu == "cpu":
        if not Path(args.calibration).is_file():
            print(f"paratron plan: {args.calibration} does not exist: calibrating this CPU on {gpn} ranks first",
                  file=sys.stderr)
            write_calibration(args.calibration, gpn, args.quiet)
        cal = load(args.calibration)
    hw = device(args.gpu, memory_gb=args.memory_gb, intra_bw_gbs=args.intra_bw_gbs,
                inter_bw_gbs=args.inter_bw_gbs, calibration=cal)
    gbs = cfg.train.global_batch_size if args.global_batch_size is None else args.global_batch_size
    seq = cfg.model.seq_length if args.seq_length is None else args.seq_length
    for name, v in (("--global-batch-size", gbs), ("--seq-length", seq)):
        if v < 1:
            raise ConfigError(f"{name}={v} must be a positive integer (>= 1)")
    model = dataclasses.replace(model_with_vocab(cfg), seq_length=seq)
    return Problem(model, Shape.of(model, seq), Cluster(args.nodes, gpn, hw), gbs, seq)


def run(args: argparse.Namespace) -> int:
    try:
        if args.calibrate:
            return _calibrate(args)
        return _plan(args)
    except (ConfigError, ValueError, OSError) as e:  # OSError: --output/--calibration not writable
        print(f"paratron plan: {e}", file=sys.stderr)
        return 2


def write_calibration(path: str | Path, nproc: int, quiet: bool = False) -> dict:
    """Measure this CPU on ``nproc`` ranks (:func:`.calibrate.calibrate`) and write the figures
    to ``path`` as JSON; returns them."""
    out = calibrate(nproc, quiet=quiet)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"paratron plan: wrote {path}", file=sys.stderr)
    return out


def _calibrate(args: argparse.Namespace) -> int:
    out = write_calibration(args.calibration, args.gpus_per_node or 4, args.quiet)
    print(json.dumps(out, indent=2))
    return 0


def _plan(args: argparse.Namespace) -> int:
    cfg = base_config(args)
    prob = problem(args, cfg)
    result = plan(prob, cfg, args.top_k, quiet=args.quiet)
    hw = prob.cluster.hw
    print(f"{prob.cluster.world} x {hw.name} ({prob.cluster.nodes} node(s) x {prob.cluster.gpus_per_node}), "
          f"{hw.memory_bytes / 1e9:.3g} GB each; global batch {prob.global_batch_size} x {prob.seq_length} tokens; "
          f"{result.accepted} layouts accepted by the validator, {result.too_big} too big, "
          f"{result.simulated} simulated")
    print(report.table(result.plans))
    if args.explain is not None:
        i = min(max(args.explain, 1), len(result.plans)) - 1
        print()
        print(report.explain(result.plans[i], prob))
    if args.verify:
        print()
        print(verify(cfg, result.plans, prob, args.verify, quiet=args.quiet))
    if args.output:
        command = "paratron plan " + " ".join(shlex.quote(a) for a in sys.argv[2:])
        Path(args.output).write_text(report.plan_toml(cfg, result.plans[0], prob, command))
        print(f"wrote {args.output}: paratron train --config {args.output} --nproc-per-node "
              f"{prob.cluster.gpus_per_node}")
    return 0
