"""Online pipeline re-layout: change ``parallel.pipeline_layout`` of a running job at a step
boundary, in memory, with the same processes (docs/elastic.md).

The pipeline degree, DP and TP stay fixed; only the split of the transformer layers between the
stages moves (FlexTrain, MLSys'26, changes the stage split without touching the math). At a step
boundary every rank agrees on one request (:func:`agree_on_request`; a callback's
``state.request_relayout(layout)`` or the file of ``paratron resize``), then the trainer
(``Trainer.relayout_to``):

1. checks the new layout with the one rule of the split (``pipeline.partition.stage_layers``);
   a layout that does not fit is refused on every rank with the rule's message, and nothing changes;
2. builds this rank's new model chunks, DDP buckets, optimizer and LR schedule for the new layout
   (``training.builders.build_model_and_optimizer``);
3. fills each new tensor (model params, fp32 main weights, moments), matched by the checkpoint
   key of its logical name (``checkpoint.items``): from this rank's old tensors where it held the
   layer already, else point-to-point over the pipeline group from the stage that held it (DP and
   TP coordinates are unchanged, so the old owner's chunk has the same shape and offsets);
4. carries over the optimizer's scalar state, the LR schedule and the RNG streams.

Nothing is written to disk. Supported: ZeRO-0 (every DP rank holds whole-layer optimizer state).
ZeRO-1/2/3 slice the flat buckets over DP, and the slices move with the set of layers a stage
holds, so a moved slice may come from another DP rank too: refused for now with a clear message.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.checkpoint import rng
from paratron.checkpoint.items import merge, model_items, optimizer_items
from paratron.pipeline.partition import stage_layers

REQUEST_FILE = "relayout_request.json"
"""The file ``paratron resize RUN_DIR --layout ...`` drops in the run directory; rank 0 of the
running job reads (and removes) it at the next step boundary."""


class RelayoutRefused(ValueError):
    """A re-layout request that cannot be met; the job continues with its current layout."""


def take_request_file(run_dir: Path | None, rank: int) -> list[int] | None:
    """Rank 0: the layout of a request dropped by ``paratron resize`` in ``run_dir`` (the file is
    removed, so it is taken once); None on other ranks or when there is none."""
    path = Path(run_dir) / REQUEST_FILE if run_dir is not None else None
    if rank != 0 or path is None or not path.is_file():
        return None
    layout = json.loads(path.read_text(encoding="utf-8"))["layout"]
    path.unlink()
    return [int(x) for x in layout]


def agree_on_request(ctx, local: list[int] | None) -> list[int] | None:
    """The layout every rank applies after this step, or None (collective, host side).

    One host all-reduce of a flag per step; only when some rank holds a request, one
    ``all_gather_object``: the lowest rank's request wins, so every rank acts on the same one.
    """
    flag = torch.tensor([0.0 if local is None else 1.0])
    ctx.world.host_all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag[0] == 0:
        return None
    requests = ctx.world.all_gather_object(local)
    return next(list(r) for r in requests if r is not None)


def write_request(run_dir: Path, layout: list[int]) -> Path:
    """Drop a re-layout request for the job running in ``run_dir`` (``paratron resize``)."""
    path = Path(run_dir) / REQUEST_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"layout": [int(x) for x in layout]}), encoding="utf-8")
    tmp.replace(path)  # atomic: the job never reads half a request
    return path


def check_request(cfg, layout: list[int]) -> None:
    """Refuse a layout the running job cannot take.

    Raises:
        RelayoutRefused: the layout does not fit the layer count or the pipeline degree (the split
            rule's message), or the job runs under ZeRO > 0 (not supported yet).
    """
    p = cfg.parallel
    try:
        stage_layers(cfg.model.num_layers, p.pipeline, p.virtual_pipeline, layout, p.schedule)
    except ValueError as e:
        raise RelayoutRefused(f"re-layout to {layout} refused: {e}") from None
    if p.zero != 0:
        raise RelayoutRefused(f"re-layout to {layout} refused: parallel.zero={p.zero}; online re-layout moves "
                              "whole-layer optimizer state and supports parallel.zero=0 only")


def state_items(chunks, optimizer) -> dict:
    """Checkpoint key -> this rank's chunks of model params and optimizer state (in-place views)."""
    return merge(model_items(chunks, for_save=False), optimizer_items(optimizer))


def move_state(ctx, old: dict, new: dict) -> int:
    """Fill every chunk of ``new`` from ``old`` (both :func:`state_items`): a local copy where
    this rank held the key, else a receive from the pipeline stage that held it; this rank sends
    what the other stages now need. Collective over the pipeline group. Returns the number of
    elements received.

    Raises:
        RuntimeError: a key that no stage held (the layouts describe different models).
    """
    held = ctx.pp.all_gather_object(sorted(old))
    wanted = ctx.pp.all_gather_object(sorted(k for k in new if k not in old))
    owner = {}
    for stage, keys in enumerate(held):
        for k in keys:
            owner.setdefault(k, stage)
    ops, landed = [], []  # (receive buffer, the chunk it fills): gloo receives into contiguous memory
    me = ctx.pp.rank
    for stage, keys in enumerate(wanted):
        for k in keys:
            if k not in owner:
                raise RuntimeError(f"rank {ctx.rank}: re-layout: no pipeline stage holds {k}")
            if stage == me:
                for c in new[k]:
                    landed.append((torch.empty(c.tensor.shape, dtype=c.tensor.dtype, device=c.tensor.device),
                                   c.tensor))
                    ops.append(ctx.pp.p2p_op("recv", landed[-1][0], owner[k]))
            elif owner[k] == me:
                for c in old[k]:
                    ops.append(ctx.pp.p2p_op("send", c.tensor.contiguous(), stage))
    for work in ctx.pp.batch_isend_irecv(ops) if ops else ():
        work.wait()
    with torch.no_grad():
        for k, chunks in new.items():
            for dst, src in zip(chunks, old.get(k, ())):
                dst.tensor.copy_(src.tensor)
        for buf, dst in landed:
            dst.copy_(buf)
    return sum(buf.numel() for buf, _ in landed)
