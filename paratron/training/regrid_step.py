"""The trainer's side of changing the pipeline degree at a step boundary (the mechanics:
:mod:`paratron.elastic.regrid`; docs/elastic.md, "Changing the pipeline degree").

A survivor rebuilds the grid-dependent parts of its :class:`~paratron.training.trainer.Trainer`
with the builders ``Trainer.__init__`` calls, in its order, so that their collectives meet a
newcomer's ``Trainer.__init__`` (:func:`rebuild`); a leaver hands over and sets ``trainer.left``.
"""

from __future__ import annotations

import pickle
import time

from paratron.checkpoint import rng
from paratron.elastic.regrid import UnionGroup, call_key, mover, plan_change, remake_world
from paratron.elastic.relayout import RelayoutRefused, layout_name, move_state, state_items
from paratron.training.builders import build_checkpoint_manager, build_model_and_optimizer
from paratron.training.data_iter import TrainingData
from paratron.training.evaluator import Evaluator
from paratron.training.groups import context_for
from paratron.training.step_log import log


def carried(trainer) -> dict:
    """What a newcomer takes from rank 0: the optimizer's scalar state, the LR schedule, every
    count of a checkpoint's ``extra`` (data position included), the schedule's microbatch time and
    the DP split of the microbatches."""
    return {"scalar": trainer.optimizer.scalar_state(), "scheduler": trainer.scheduler.state_dict(),
            "progress": trainer.progress(), "microbatch_time": (trainer.microbatch_time, trainer.measure_step),
            "dp_microbatches": trainer.state.dp_microbatches}


def change_pipeline(trainer, pipeline: int, layout: list | None) -> None:
    """A training rank's part of changing ``parallel.pipeline`` to ``pipeline`` (module
    docstring). A survivor goes on training at the new grid; a leaver sets ``trainer.left``
    after handing over its state. Collective over the old world, then the union.

    Raises:
        RelayoutRefused: :func:`plan_change` refused it; nothing has changed.
    """
    session, cfg, ctx = trainer.elastic, trainer.cfg, trainer.ctx
    if session is None:
        raise RelayoutRefused(f"re-layout to parallel.pipeline={pipeline} refused: the job was not started "
                              "through paratron's runner with train.elastic_relayout=true")
    change = plan_change(cfg, ctx.grid, pipeline, layout, session.spares)
    t0, before = time.perf_counter(), (cfg.parallel.pipeline, layout_name(cfg, cfg.parallel.pipeline_layout))
    if trainer.ckpt is not None:
        trainer.ckpt.wait()  # a save in flight uses the old groups
    old, streams = state_items(trainer.chunks, trainer.optimizer), rng.capture(trainer.chunks)
    gen, rank = session.generation + 1, change.new_rank[ctx.rank]
    cfg.parallel.pipeline, cfg.parallel.pipeline_layout = pipeline, layout
    session.spares = session.spares[len(change.newcomers):]
    if ctx.rank == 0:
        for slot, new_rank in change.newcomers:
            session.store.set(call_key(slot), pickle.dumps({
                "generation": gen, "rank": new_rank, "world": change.new.world, "union_size": change.union_size,
                "config": cfg, "spares": session.spares, "stages": change.stages()}))
    union = UnionGroup(session, gen, change.union_rank(ctx.rank), change.union_size)
    remake_world(session, gen, rank, change.new.world)
    if rank is None:  # a leaver: hand over, then leave the loop
        move_state(mover(union, change.stages()), old, {})
        union.all_gather_object(None)
        trainer.left = True
        return
    carry = carried(trainer)  # of the old optimizer and schedule, before the rebuild
    rebuild(trainer, context_for(cfg))
    moved = move_state(mover(union, change.stages()), old, state_items(trainer.chunks, trainer.optimizer))
    union.all_gather_object(carry if rank == 0 else None)
    trainer.adopt(carry["scalar"], carry["scheduler"], streams)
    log(trainer.ctx, f"re-layout at iteration {trainer.state.iteration}: parallel.pipeline {before[0]} -> {pipeline}"
                     f", {before[1]} -> {layout_name(cfg, layout)}, world {change.old.world} -> {change.new.world}, "
                     f"in memory ({time.perf_counter() - t0:.2f} s; rank 0 received {moved:,} elements)")


def rebuild(trainer, ctx) -> None:
    """A survivor: the parts of a :class:`~paratron.training.trainer.Trainer` that depend on the
    grid, built with the builders ``Trainer.__init__`` calls, in its order (their collectives
    meet a newcomer's ``Trainer.__init__``): data reader, model chunks with DDP, optimizer and LR
    schedule, checkpoint manager. The new tensors are filled afterwards."""
    cfg = trainer.cfg
    data = TrainingData.build(cfg, ctx)
    data.load_state_dict(trainer.data.state_dict())
    built = build_model_and_optimizer(cfg, ctx)
    ckpt = build_checkpoint_manager(cfg, ctx)
    flight = ctx.ledger.flight = trainer.ctx.ledger.flight  # the hang watchdog's recorder follows the groups
    if flight is not None:
        flight.restart_counts()  # as a newcomer's, which starts after its Trainer is built
    trainer.ctx = trainer.state.ctx = trainer.step_log.ctx = trainer.observer.ctx = ctx
    trainer.data, trainer.ckpt = data, ckpt
    trainer.chunks, trainer.ddp, trainer.optimizer, trainer.scheduler = built
    trainer.evaluator = Evaluator(cfg, ctx, trainer.chunks, data, trainer.actions_for)
