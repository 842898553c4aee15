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

from paratron.config import ConfigError, Config, build_config, megatron_overrides, validate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set parallel.tensor=2 (repeatable)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="train on this text: a .jsonl/.json/.txt file or a directory of them (tokenised on "
                        "first use into the data cache), or an existing .bin/.idx prefix; replaces the "
                        "config's data.corpus and data.data_path")
    p.add_argument("--run-dir", default=None,
                   help="where metrics.jsonl, tensorboard/ and loss.png go (default: runs/<config file stem>, "
                        "or runs/latest without --config)")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start torchrun with this many ranks on this node")
    p.add_argument("--nnodes", default="1", help="torchrun --nnodes (with --nproc-per-node)")
    p.add_argument("--node-rank", type=int, default=0, help="torchrun --node-rank")
    p.add_argument("--rdzv-endpoint", default=None, help="torchrun rendezvous host:port for several nodes")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse, translating Megatron-style flags into overrides first."""
    try:
        aliases, rest = megatron_overrides(argv)
    except ConfigError as e:
        parser.error(str(e))
    args = parser.parse_args(rest)
    args.overrides = aliases + args.overrides
    args.argv = argv
    return args


def world_size_for(args: argparse.Namespace) -> int:
    """The world size this invocation will have: torchrun's, or nproc x nnodes, or 1."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if args.nproc_per_node:
        return args.nproc_per_node * int(str(args.nnodes).split(":")[-1])
    return 1


def load_and_validate(args: argparse.Namespace) -> Config:
    """Config from file + overrides, validated for this world size (no process group yet)."""
    from paratron.training.preflight import apply_data_argument, check_paths, import_plugins

    cfg = build_config(args.config, args.overrides)
    apply_data_argument(cfg, getattr(args, "data", None), args.overrides)
    try:  # first: the config may name schedules, dispatchers or blocks that plugins register
        import_plugins(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    validate(cfg, world_size_for(args))
    check_paths(cfg)
    print_config_warnings(cfg, launching=bool(args.nproc_per_node) and "WORLD_SIZE" not in os.environ)
    return cfg


def print_config_warnings(cfg: Config, launching: bool) -> None:
    """Print :func:`~paratron.config.validators.config_warnings` once per run, one line each: in
    the launcher, or else on rank 0 (a launcher marks its ranks so they stay quiet)."""
    from paratron.config.validators import config_warnings

    if launching:
        os.environ[_WARNED] = "1"  # inherited by the ranks torchrun starts
    elif os.environ.get(_WARNED) or os.environ.get("RANK", "0") != "0":
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
    return cmd + rest


def launch_or_run(args: argparse.Namespace, command: str, body, prepare=None) -> int:
    """Validate (and ``prepare(cfg, args)``, which may raise ConfigError), then either re-exec
    under torchrun or call ``body(cfg, args)`` in this process."""
    try:
        cfg = load_and_validate(args)
        if prepare is not None:
            prepare(cfg, args)
    except ConfigError as e:
        hint = ""
        if "world size" in str(e) and "WORLD_SIZE" not in os.environ and not args.nproc_per_node:
            hint = " (to start several ranks, add --nproc-per-node N, or launch with torchrun)"
        print(f"paratron {command}: config error: {e}{hint}", file=sys.stderr)
        return 2
    if args.nproc_per_node and "WORLD_SIZE" not in os.environ:
        cmd = torchrun_argv(args, ["-m", "paratron", command] + args.argv)
        return run_torchrun(cmd)
    return body(cfg, args)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def run_torchrun(cmd: list[str]) -> int:
    """Run torchrun in its own session; SIGTERM/SIGINT to this process go to the ranks only.

    The ranks then finish their step, save and exit 0, so torchrun's agent sees a clean finish.
    (Signalled itself, the agent would stop the ranks after a grace period and exit non-zero.)
    """
    import signal
    import subprocess

    # torchrun gives each rank one thread by default; keep it so (OMP_NUM_THREADS=1).
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, frame):
        for child in _children(proc.pid):
            try:
                os.kill(child, signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # pragma: no cover - the handler above takes SIGINT
                forward(signal.SIGINT, None)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def default_run_dir(config_path: str | None) -> str:
    """``runs/<config file stem>`` (``runs/default`` for configs/default.toml), else ``runs/latest``."""
    from pathlib import Path

    return f"runs/{Path(config_path).stem}" if config_path else "runs/latest"


def run(args: argparse.Namespace) -> int:
    def body(cfg: Config, a: argparse.Namespace) -> int:
        from paratron.training.runner import run_training

        return run_training(cfg, run_dir=a.run_dir or default_run_dir(a.config))

    def prepare(cfg: Config, a: argparse.Namespace) -> None:
        from paratron.training.preflight import prepare_training

        prepare_training(cfg, a.run_dir or default_run_dir(a.config))

    return launch_or_run(args, "train", body, prepare)
