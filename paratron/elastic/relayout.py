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
   key of its logical name (``checkpoint.items``) and by rectangles of the full logical tensor
   (:func:`plan_moves`): from this rank's old tensors where it held them already, else
   point-to-point from a rank that held them (the old stage; under ZeRO-1 the slices of the new
   DP partition may come from several DP ranks, of this stage or the old one);
4. carries over the optimizer's scalar state, the LR schedule and the RNG streams.

Nothing is written to disk. Every ZeRO stage is supported: the grads (sharded under ZeRO-2/3)
are empty at a step boundary, so only params and optimizer state move; under ZeRO-3 the params
live only as the flat shards of the DDP buckets, and the optimizer's fp32 main weights
(``optimizer/main_param/...``, rectangles of those shards) carry them (:func:`state_items`).
TP and sequence parallelism need nothing of their own: each chunk is a rectangle of the full
logical tensor (vocab padding excluded), whatever TP rank holds it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.checkpoint import rng
from paratron.checkpoint.io import write_json_atomic
from paratron.checkpoint.items import MODEL_PREFIX, chunks_from_param, iter_params, merge, model_items, optimizer_items
from paratron.parallel.params import meta_of
from paratron.pipeline.partition import stage_layers, stage_sizes

REQUEST_FILE = "relayout_request.json"
"""The file ``paratron resize RUN_DIR --layout ...`` drops in the run directory; rank 0 of the
running job reads (and removes) it at the next step boundary."""


ANSWER_FILE = "relayout_answer.json"
"""Rank 0's answer to a request of ``paratron resize`` (``{"id", "outcome", "message"}``,
``outcome`` "applied" or "refused"), which the command waits for."""


class RelayoutRefused(ValueError):
    """A re-layout request that cannot be met; the job continues with its current layout."""


def take_request_file(run_dir: Path | None, rank: int) -> dict | None:
    """Rank 0: the request ``{"layout": [...] | None, "pipeline": P | None}`` dropped by ``paratron
    resize`` in ``run_dir`` (the file is removed, so it is taken once); None on other ranks or when
    there is none."""
    path = Path(run_dir) / REQUEST_FILE if run_dir is not None else None
    if rank != 0 or path is None or not path.is_file():
        return None
    taken = request(**json.loads(path.read_text(encoding="utf-8")))
    path.unlink()
    return taken


def discard_request(run_dir: Path) -> bool:
    """Remove a request file left in ``run_dir`` by a ``paratron resize`` whose job has ended
    (called as a new job takes the run directory's lock); True when there was one."""
    path = Path(run_dir) / REQUEST_FILE
    if not path.is_file():
        return False
    path.unlink(missing_ok=True)
    return True


def request(layout=None, pipeline=None, id=None) -> dict:
    """A re-layout request: the new ``parallel.pipeline_layout`` (None: the default split) and
    the new ``parallel.pipeline`` (None: unchanged, :mod:`paratron.elastic.regrid` otherwise);
    ``id``: set by ``paratron resize``, which waits for the answer under that id."""
    req = {"layout": None if layout is None else [int(x) for x in layout],
           "pipeline": None if pipeline is None else int(pipeline)}
    if id is not None:
        req["id"] = str(id)
    return req


def agree_on_request(ctx, local: dict | None) -> dict | None:
    """The :func:`request` every rank applies after this step, or None (collective, host side).

    One host all-reduce of a flag per step; only when some rank holds a request, one
    ``all_gather_object``: the lowest rank's request wins, so every rank acts on the same one.
    """
    flag = torch.tensor([0.0 if local is None else 1.0])
    ctx.world.host_all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag[0] == 0:
        return None
    requests = ctx.world.all_gather_object(local)
    return next(r for r in requests if r is not None)


def write_request(run_dir: Path, layout: list[int] | None, pipeline: int | None = None,
                  id: str | None = None) -> Path:
    """Drop a re-layout request for the job running in ``run_dir`` (``paratron resize``).

    Raises:
        RelayoutRefused: a request is already waiting there (it is never overwritten: its
            sender waits for the answer to it).
    """
    path = Path(run_dir) / REQUEST_FILE
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(request(layout, pipeline, id)), encoding="utf-8")
    try:
        os.link(tmp, path)  # atomic, and never over another request (os.replace would be)
    except FileExistsError:
        raise RelayoutRefused(f"another re-layout request is waiting for the job's next step boundary "
                              f"({path}); wait for its answer, then ask again") from None
    finally:
        tmp.unlink()
    return path


def write_answer(run_dir: Path | None, req: dict, outcome: str, message: str) -> None:
    """Rank 0: answer a request that came with an ``id`` (:data:`ANSWER_FILE`); a callback's
    request has none and gets no file."""
    if run_dir is not None and req.get("id"):
        write_json_atomic(Path(run_dir) / ANSWER_FILE, {"id": req["id"], "outcome": outcome, "message": message})


def read_answer(run_dir: Path, id: str) -> dict | None:
    """The job's answer to the request ``id``, or None while there is none."""
    try:
        answer = json.loads((Path(run_dir) / ANSWER_FILE).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return answer if answer.get("id") == id else None


def layout_name(cfg, layout: list[int] | None) -> str:
    """How a message names the requested ``parallel.pipeline_layout`` at ``cfg``'s pipeline
    degree: None is the even split (``pipeline.partition.stage_sizes``), spelled out when it fits."""
    if layout is not None:
        return f"pipeline_layout={list(layout)}"
    p = cfg.parallel
    try:
        split = f" {stage_sizes(cfg.model.num_layers, p.pipeline, p.virtual_pipeline)}"
    except ValueError:
        split = (f" of model.num_layers={cfg.model.num_layers} over parallel.pipeline*virtual_pipeline = "
                 f"{p.pipeline * p.virtual_pipeline} stages")
    return f"pipeline_layout=None (the even split{split})"


def check_request(cfg, layout: list[int] | None) -> None:
    """Refuse a layout the running job cannot take (None: the even split).

    Raises:
        RelayoutRefused: the layout does not fit the layer count or the pipeline degree (the split
            rule's message).
    """
    p = cfg.parallel
    try:
        stage_layers(cfg.model.num_layers, p.pipeline, p.virtual_pipeline, layout, p.schedule)
    except ValueError as e:
        raise RelayoutRefused(f"re-layout to {layout_name(cfg, layout)} refused: {e}") from None


def state_items(chunks, optimizer) -> dict:
    """Checkpoint key -> this rank's chunks of model params and optimizer state (in-place views).

    Under ZeRO-3 a param in a DDP bucket has no storage of its own between uses (its ``.data``
    is empty; the bucket's flat shard holds this rank's part), so it is left out here: its values
    travel as ``optimizer/main_param/<logical_name>``, rectangles of the shard, and
    ``optimizer.reload_model_params()`` writes them back into the param shards (the params equal
    the cast main weights after every step). Params outside the buckets (frozen ones) keep their
    full storage and move as ``model/<logical_name>``.
    """
    shards = optimizer.ddp.param_shards
    if shards is None:
        return merge(model_items(chunks, for_save=False), optimizer_items(optimizer))
    sharded = {id(p) for buf in shards.buffers for p in buf.params}
    model: dict = {}
    for p in iter_params(chunks):
        if id(p) not in sharded:
            model.setdefault(MODEL_PREFIX + meta_of(p).logical_name, []).extend(chunks_from_param(p))
    return merge(model, optimizer_items(optimizer))


def _layout_of(items: dict) -> dict:
    """Key -> ``[(offsets, shape), ...]`` of :func:`state_items`: what the other ranks need to plan."""
    return {k: [(tuple(c.offsets), tuple(c.tensor.shape)) for c in chunks] for k, chunks in items.items()}


def _overlap(a_off, a_shape, b_off, b_shape):
    """The intersection of two rectangles as ``(lo, hi)`` per dim, or None when empty."""
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape)]
    return (lo, hi) if all(h > l for l, h in zip(lo, hi)) else None


def _window(t: torch.Tensor, off, lo, hi) -> torch.Tensor:
    """The part ``[lo, hi)`` (full-tensor coordinates) of chunk ``t`` that starts at ``off``."""
    for d, (o, l, h) in enumerate(zip(off, lo, hi)):
        t = t.narrow(d, l - o, h - l)
    return t


def plan_moves(old: list[dict], new: list[dict], stage: list[int]) -> list[tuple]:
    """Where each rank's new chunks come from: ``(dst, key, chunk, src, src_chunk, lo, hi)``, one
    per rectangle, the same list on every rank.

    Args:
        old, new: per rank, :func:`_layout_of` its old and new :func:`state_items`.
        stage: per rank, its pipeline rank.

    Sources are taken in preference order (the rank itself, then its own stage, then the others
    from the next rank on, which spreads the sends); a source rectangle that overlaps one already
    taken is skipped (replicas: DP copies, the tied embedding's copy on the last stage).

    Raises:
        RuntimeError: a new chunk that the old chunks do not cover.
    """
    world, plan = len(new), []
    for dst in range(world):
        order = sorted(range(world), key=lambda r: (r != dst, stage[r] != stage[dst], (r - dst) % world))
        for key in sorted(new[dst]):
            for ci, (off, shape) in enumerate(new[dst][key]):
                taken, need = [], math.prod(shape)
                for src in order:
                    for si, (o, sh) in enumerate(old[src].get(key, ())):
                        box = _overlap(off, shape, o, sh)
                        if box is None or any(_overlap(box[0], [h - l for l, h in zip(*box)], t[0],
                                                       [h - l for l, h in zip(*t)]) for t in taken):
                            continue
                        taken.append(box)
                        plan.append((dst, key, ci, src, si, *box))
                got = sum(math.prod(h - l for l, h in zip(*t)) for t in taken)
                if got != need:
                    raise RuntimeError(f"re-layout: {key} chunk at {off} on rank {dst}: the old layout holds "
                                       f"{got} of its {need} elements")
    return plan


def move_state(ctx, old: dict, new: dict) -> int:
    """Fill every chunk of ``new`` from ``old`` (both :func:`state_items`) by the rectangles of
    :func:`plan_moves`: a local copy where this rank held them, else a point-to-point receive
    (``comm.Group.p2p_op`` over the world) from a rank that held them. Collective over the world.
    Returns the number of elements this rank received.

    Raises:
        RuntimeError: see :func:`plan_moves`.
    """
    me = ctx.world.rank
    gathered = ctx.world.all_gather_object((_layout_of(old), _layout_of(new), ctx.pp.rank))
    plan = plan_moves([g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered])
    ops, landed, local = [], [], []  # gloo receives into contiguous buffers, copied in after the wait
    for dst, key, ci, src, si, lo, hi in plan:
        if dst == me and src == me:
            local.append((_window(new[key][ci].tensor, new[key][ci].offsets, lo, hi),
                          _window(old[key][si].tensor, old[key][si].offsets, lo, hi)))
        elif dst == me:
            into = _window(new[key][ci].tensor, new[key][ci].offsets, lo, hi)
            landed.append((torch.empty(into.shape, dtype=into.dtype, device=into.device), into))
            ops.append(ctx.world.p2p_op("recv", landed[-1][0], src))
        elif src == me:
            ops.append(ctx.world.p2p_op("send", _window(old[key][si].tensor, old[key][si].offsets, lo, hi)
                                        .contiguous(), dst))
    for work in ctx.world.batch_isend_irecv(ops) if ops else ():
        work.wait()
    with torch.no_grad():
        for dst, src in local + [(into, buf) for buf, into in landed]:
            dst.copy_(src)
    return sum(buf.numel() for buf, _ in landed)
