"""``paratron train``: validate the config, launch ranks if asked, then run the training loop.

Usage::

    paratron train --config FILE [--set section.key=value ...] [--run-dir DIR] [--nproc-per-node N]
    torchrun --nproc-per-node N -m paratron train --config FILE ...

Megatron-LM flags (``--tensor-model-parallel-size 2``, ``--sequence-parallel``, ...) are accepted
as aliases of the matching keys (see ``paratron.config.MEGATRON_ALIASES``). The config is checked
against the world size before any process group is created.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from paratron.checkpoint.hf_load import apply_load_hf
from paratron.checkpoint.items import CheckpointError
from paratron.data.chat import ChatFormatError
from paratron.data.corpus import BadInputError
from paratron.data.provenance import TokenizerMismatchError
from paratron.config import ConfigError, Config, megatron_overrides
from paratron.config.validators import config_warnings
from paratron.rules import build_config, validate
from paratron.launch import launch  # launch.run_torchrun, looked up at the call (tests replace it)
from paratron.launch.auto_restart import run_with_restarts
from paratron.launch.elastic import ElasticLaunch, rank_argv
from paratron.launch.mode import Mode, started
from paratron.launch.rankproc import rank_session
from paratron.elastic.relayout import REQUEST_FILE, discard_request
from paratron.launch.runlock import RunLocked, lock_run, stale_note
from paratron.launch.runner import run_training
from paratron.training.preflight import apply_data_argument, check_paths, import_plugins, prepare_training


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set parallel.tensor=2 (repeatable)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on this text: a .jsonl/.json/.txt file or a directory of them (tokenised on "
                        "first use into the data cache), or an existing .bin/.idx prefix; replaces the "
                        "config's data.corpus and data.data_path")
    p.add_argument("--from-hf", default=None, metavar="DIR",
                   help="start from a Hugging Face folder: model config, tokenizer and weights (each rank "
                        "reads only its slices); checkpoint.load_hf=DIR")
    p.add_argument("--save-hf", default=None, metavar="DIR",
                   help="after training, export a Hugging Face folder to DIR and check it against "
                        "transformers (checkpoint.save_hf=DIR, train.export_hf_at_end=true)")
    p.add_argument("--save-peft", default=None, metavar="DIR",
                   help="LoRA runs: after training, write the adapters for peft to DIR and the base model "
                        "to DIR/base (checkpoint.save_peft=DIR, train.export_hf_at_end=true)")
    p.add_argument("--run-dir", default=None,
                   help="where metrics.jsonl, tensorboard/ and loss.png go (default: runs/<config file stem>, "
                        "or runs/latest without --config)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start torchrun with this many ranks on this node")
    p.add_argument("--nnodes", default="1", help="torchrun --nnodes (with --nproc-per-node)")
    p.add_argument("--node-rank", type=int, default=0, help="torchrun --node-rank")
    p.add_argument("--rdzv-endpoint", default=None, help="torchrun rendezvous host:port for several nodes")
    p.add_argument("--auto-restart", type=int, default=0, metavar="N",
                   help="with --nproc-per-node: restart the job up to N times when it exits for a fail-slow "
                        "restart (code 75, train.failslow_restart), resuming from its checkpoint; with "
                        "several nodes, the slow rank's node is left out (paratron/launch/auto_restart.py)")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse, translating Megatron-style flags into overrides first."""
    try:
        aliases, rest = megatron_overrides(argv)
    except ConfigError as e:
        parser.error(str(e))
    args = parser.parse_args(rest)
    args.overrides = aliases + args.overrides + hf_overrides(args)
    args.argv = argv
    return args


def hf_overrides(args: argparse.Namespace) -> list[str]:
    """The config keys that ``--from-hf``, ``--save-hf`` and ``--save-peft`` stand for."""
    out = [f"checkpoint.load_hf={args.from_hf}"] if args.from_hf else []
    if args.save_hf:
        out += [f"checkpoint.save_hf={args.save_hf}", "train.export_hf_at_end=true"]
    if getattr(args, "save_peft", None):
        out += [f"checkpoint.save_peft={args.save_peft}", "train.export_hf_at_end=true"]
    return out


def world_size_for(args: argparse.Namespace) -> int:
    """The world size this invocation will have: torchrun's, or nproc x nnodes, or 1."""
    me = started(args.nproc_per_node)
    if me.torchrun:
        return me.world_size
    if me.mode is Mode.LAUNCHER:
        return args.nproc_per_node * int(str(args.nnodes).split(":")[-1])
    return 1


def load_and_validate(args: argparse.Namespace) -> Config:
    """Config from file + overrides, validated for this world size (no process group yet)."""
    cfg = build_config(args.config, args.overrides)
    apply_data_argument(cfg, getattr(args, "data", None), args.overrides)
    apply_load_hf(cfg, args.overrides)
    try:  # first: the config may name schedules, dispatchers or blocks that plugins register
        import_plugins(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    validate(cfg, world_size_for(args))
    check_paths(cfg)
    print_config_warnings(cfg, launching=started(args.nproc_per_node).mode is Mode.LAUNCHER)
    return cfg


def print_config_warnings(cfg: Config, launching: bool) -> None:
    """Print :func:`~paratron.config.validators.config_warnings` once per run, one line each: in
    the launcher, or else on rank 0 (a launcher marks its ranks so they stay quiet)."""
    if launching:
        os.environ[_WARNED] = "1"  # inherited by the ranks torchrun starts
    elif os.environ.get(_WARNED) or started().rank != 0:
        return
    for line in config_warnings(cfg):
        print(f"paratron: warning: {line}", file=sys.stderr)


_WARNED = "PARATRON_CONFIG_WARNED"


def torchrun_argv(args: argparse.Namespace, module_argv: list[str]) -> list[str]:
    """The torchrun command line that relaunches this command on ``--nproc-per-node`` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}"]
    if str(args.nnodes) == "1" and not args.rdzv_endpoint:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={args.nnodes}", f"--node-rank={args.node_rank}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={args.rdzv_endpoint or '127.0.0.1:29400'}"]
    return cmd + without_launch_flags(module_argv)


def without_launch_flags(module_argv: list[str]) -> list[str]:
    """``module_argv`` without the flags that only the launcher reads (a rank must not launch again)."""
    skip = {"--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint"}
    rest, i = [], 0
    while i < len(module_argv):
        a = module_argv[i]
        flag = a.split("=", 1)[0]
        if flag in skip:
            i += 1 if "=" in a else 2
            continue
        rest.append(a)
        i += 1
    return rest


def launch_or_run(args: argparse.Namespace, command: str, body, prepare=None) -> int:
    """Validate (and ``prepare(cfg, args)``, which may raise ConfigError), then either re-exec
    under torchrun or call ``body(cfg, args)`` in this process."""
    try:
        cfg = load_and_validate(args)
        if prepare is not None:
            prepare(cfg, args)
    except ConfigError as e:
        hint = ""
        if "world size" in str(e) and started(args.nproc_per_node).mode is Mode.ALONE:
            hint = " (to start several ranks, add --nproc-per-node N, or launch with torchrun)"
        print(f"paratron {command}: config error: {e}{hint}", file=sys.stderr)
        return 2
    if started(args.nproc_per_node).mode is Mode.LAUNCHER:
        cmd = torchrun_argv(args, ["-m", "paratron", command] + args.argv)
        if command != "train":
            return launch.run_torchrun(cmd)
        if cfg.train.replace_dead_ranks:
            return launch_elastic(args, cfg)
        return launch_training(cmd, args, cfg)
    return body(cfg, args)


def launch_training(cmd: list[str], args: argparse.Namespace, cfg: Config) -> int:
    """Lock the run (on node 0), run torchrun, print one summary if it fails."""
    run_dir = Path(args.run_dir or default_run_dir(args.config))
    with run_locks(run_dir, cfg, take=args.node_rank == 0) as refused:
        if refused:
            return 2
        if getattr(args, "auto_restart", 0):
            return run_with_restarts(cmd, run_dir, args.node_rank, args.auto_restart, args.rdzv_endpoint,
                                     launch.run_torchrun)
        return launch.run_torchrun(cmd, run_dir, args.node_rank)


def elastic_refusal(args: argparse.Namespace, cfg: Config) -> str | None:
    """Why ``train.replace_dead_ranks`` cannot be had with this launch, or None."""
    if str(args.nnodes) != "1" or args.rdzv_endpoint:
        return "train.replace_dead_ranks=true runs on one node (the launcher starts every rank itself); " \
               f"--nnodes {args.nnodes} asks for several"
    if cfg.train.elastic_relayout:
        return "train.replace_dead_ranks=true does not combine with train.elastic_relayout=true (each " \
               "re-makes the process groups its own way; docs/elastic.md)"
    return None


def launch_elastic(args: argparse.Namespace, cfg: Config) -> int:
    """``train.replace_dead_ranks``: paratron's own launcher starts the ranks and replaces a dead
    one (:mod:`paratron.launch.elastic`)."""
    refused = elastic_refusal(args, cfg)
    if refused:
        print(f"paratron train: config error: {refused}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or default_run_dir(args.config))
    argv = rank_argv(without_launch_flags(["-m", "paratron", "train"] + args.argv))
    with run_locks(run_dir, cfg, take=True) as refused:
        if refused:
            return 2
        return ElasticLaunch(argv, args.nproc_per_node, run_dir, cfg).run()


@contextmanager
def run_locks(run_dir: Path, cfg: Config, take: bool):
    """Hold the locks of the run directory and ``checkpoint.save`` (:mod:`.runlock`) inside the
    block; yields True (after printing why) when another live job holds one."""
    if not take:
        yield False
        return
    try:
        locks = lock_run(run_dir, cfg.checkpoint.save)
    except RunLocked as e:
        print(f"paratron train: refused: {e}", file=sys.stderr)
        yield True
        return
    for line in stale_note(locks):
        print(f"paratron train: {line}", file=sys.stderr)
    if discard_request(run_dir):  # dropped for a job that has ended: not this one's to take
        print(f"paratron train: note: removed {run_dir / REQUEST_FILE}, a re-layout request left from an "
              "earlier job", file=sys.stderr)
    try:
        yield False
    finally:
        for lk in locks:
            lk.release()


INPUT_ERRORS = (CheckpointError, ConfigError, BadInputError, ChatFormatError, TokenizerMismatchError)
"""What bad input (a checkpoint, the config, the data) raises during a run: a single process
reports it in one line."""


def default_run_dir(config_path: str | None) -> str:
    """``runs/<config file stem>`` (``runs/default`` for configs/default.toml), else ``runs/latest``."""
    return f"runs/{Path(config_path).stem}" if config_path else "runs/latest"


def run(args: argparse.Namespace) -> int:
    def body(cfg: Config, a: argparse.Namespace) -> int:
        run_dir = Path(a.run_dir or default_run_dir(a.config))
        # Under the launcher, it holds the locks; under a bare torchrun (or alone), rank 0 does.
        me = started()
        if getattr(a, "auto_restart", 0) and not me.under_launcher:
            print("paratron train: --auto-restart needs --nproc-per-node N (the launcher restarts the ranks)",
                  file=sys.stderr)
            return 2
        take = not me.under_launcher and me.rank == 0
        with rank_session(), run_locks(run_dir, cfg, take) as refused:
            if refused:
                return 2
            try:
                return run_training(cfg, run_dir=str(run_dir))
            except INPUT_ERRORS as e:
                if me.mode is not Mode.ALONE:  # a rank: its traceback goes to its log, the launcher sums up
                    raise
                print(f"paratron train: error: {type(e).__name__}: {e}", file=sys.stderr)  # alone: one line
                return 1

    def prepare(cfg: Config, a: argparse.Namespace) -> None:
        prepare_training(cfg, a.run_dir or default_run_dir(a.config), launching=not started().torchrun)

    return launch_or_run(args, "train", body, prepare)
