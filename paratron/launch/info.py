"""``paratron info``: build the parallel context of a config and report every rank's groups.

Under torchrun every rank joins; rank 0 prints (and with ``--output`` writes as JSON) the world:
for each global rank its node (torchrun's ``GROUP_RANK``), local rank and coordinates. Without
torchrun it prints the layout computed for ``--world-size`` ranks, with no process at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from paratron.config import ConfigError
from paratron.launch.command import add_arguments as add_train_arguments
from paratron.launch.mode import Mode, started
from paratron.parallel.context import ParallelContext, init_distributed
from paratron.parallel.grid import build_grid
from paratron.rules import build_config, validate
from paratron.training.groups import groups_used
from paratron.launch.command import launch_or_run, parse  # noqa: F401 (parse used by cli)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_train_arguments(p)
    p.add_argument("--world-size", type=int, default=None, help="show the layout for this many ranks")
    p.add_argument("--output", default=None, help="write the world as JSON (rank 0)")


def _describe_grid(cfg, world: int) -> dict:
    p = cfg.parallel
    grid = build_grid(world, tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                      expert_tp=p.expert_tensor, order=p.order)
    return {"world": world, "dp": grid.dp, "expert_dp": grid.expert_dp, "groups": grid.groups,
            "groups_used_by_training": list(groups_used(cfg))}


def format_world(world: dict) -> str:
    """``world`` as JSON with one line per key and per group kind (``"tp": [[0, 1], [2, 3]]``):
    ``json.dumps(indent=...)`` would put every rank of every group on its own line, hundreds of
    lines for a 4-rank layout."""
    def entry(key, value, pad):
        if isinstance(value, dict):
            inner = ",\n".join(entry(k, v, pad + " ") for k, v in value.items())
            return f"{pad}{json.dumps(key)}: {{\n{inner}\n{pad}}}"
        return f"{pad}{json.dumps(key)}: {json.dumps(value)}"

    return "{\n" + ",\n".join(entry(k, v, " ") for k, v in world.items()) + "\n}"


def run(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        print(f"paratron info: --world-size={args.world_size} must be a positive integer (ranks)", file=sys.stderr)
        return 2
    if args.world_size and started(args.nproc_per_node).mode is Mode.ALONE:
        try:
            cfg = validate(build_config(args.config, args.overrides), args.world_size)
        except ConfigError as e:
            print(f"paratron info: config error: {e}", file=sys.stderr)
            return 2
        world = _describe_grid(cfg, args.world_size)
        print(format_world(world))
        if args.output:
            try:
                with open(args.output, "w") as f:
                    json.dump(world, f)
            except OSError as e:
                print(f"paratron info: cannot write --output: {e}", file=sys.stderr)
                return 2
        return 0
    return launch_or_run(args, "info", _body)


def _body(cfg, args) -> int:
    import torch
    import torch.distributed as dist

    init_distributed(cfg.parallel.timeout_s)
    p = cfg.parallel
    # Only the default group is needed here; the groups are listed from the grid.
    ctx = ParallelContext.build(tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                                expert_tp=p.expert_tensor, order=p.order, kinds=("world",))
    me = torch.tensor([ctx.rank, int(os.environ.get("GROUP_RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))],
                      device=ctx.device)
    rows = ctx.world.all_gather(me.view(1, 3))
    if ctx.rank == 0:
        world = {"world_size": ctx.world_size, "layout": ctx.describe(),
                 "ranks": [{"rank": int(r), "node": int(n), "local_rank": int(lr)} for r, n, lr in rows.tolist()],
                 "groups": ctx.grid.groups, "groups_used_by_training": list(groups_used(cfg))}
        print(format_world(world))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(world, f)
    dist.destroy_process_group()
    return 0
