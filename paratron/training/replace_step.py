"""The trainer's side of replacing a dead rank in place (the mechanics and the commit point:
:mod:`paratron.elastic.replace`; docs/elastic.md, "Replacing a dead rank").

A survivor (:func:`recover`, :func:`rejoin`) lets go of the old process groups, waits for the
launcher's failure record, joins the next generation with its rank and rebuilds the grid-dependent
parts of its :class:`~paratron.training.trainer.Trainer` with the builders ``Trainer.__init__``
calls, in its order (:func:`paratron.training.regrid_step.rebuild`), so that their collectives
meet the replacement's ``Trainer.__init__``; the replacement (:func:`take_over`) then receives the
dead rank's state from its DP replica and the counts from a survivor.
"""

from __future__ import annotations

import gc
import json
import time
import traceback

from paratron.checkpoint import rng
from paratron.elastic.regroup import abort_world, release_context, remake_world
from paratron.elastic.relayout import move_state, state_items
from paratron.elastic.replace import ReplaceFailed, failed_key
from paratron.training.groups import context_for
from paratron.training.regrid_step import carried, rebuild
from paratron.training.step_log import log

FAILURE_WAIT_S = 30.0
"""How long a rank whose step failed waits for the launcher's failure record before it takes the
error for its own (the launcher sees a death within a poll, 0.1 s; the margin is for a loaded host)."""


def _handover(trainer) -> dict:
    """What a survivor hands to the replacement (and checks against the other survivors)."""
    last_step = next((r for r in reversed(trainer.state.metrics) if "loss" in r), None)
    return {**carried(trainer), "streams": rng.capture(trainer.chunks), "coords": trainer.ctx.grid.coords(trainer.ctx.rank),
            "boundary_pending": trainer.boundary_pending, "last_step": last_step}


def _same_place(a: dict, b: dict) -> bool:
    """Same stage and tensor/context coordinates: a DP replica (its RNG streams are the dead rank's)."""
    return all(a[k] == b[k] for k in ("tp", "cp", "pp", "expert_tp"))


def pending_boundary(handovers: list) -> bool:
    """Whether every rank redoes the last step's boundary: when any survivor has it pending. A
    world collective of the boundary (the stop agreement) may complete on some ranks and not on
    others; redoing it everywhere is harmless (the same agreement, a save of the same step)."""
    return any(h["boundary_pending"] for h in handovers if h is not None)


def rejoin(trainer, record: dict) -> int:
    """A survivor: join generation ``record["generation"]`` with the same rank, rebuild, keep its
    state; returns the elements received (0: everything was local). Collective over the new world.

    Raises:
        ReplaceFailed: the survivors hold different steps."""
    m, old_ctx = trainer.membership, trainer.ctx
    if trainer.ckpt is not None:
        try:
            trainer.ckpt.wait()  # a save in flight used the old groups; it may have failed with them
        except Exception as e:  # noqa: BLE001 - the last complete checkpoint stays the fallback
            log(old_ctx, f"warning: checkpoint save in flight at the rank's death failed: {e}")
    old, handover = state_items(trainer.chunks, trainer.optimizer), _handover(trainer)
    m.generation = record["generation"]
    remake_world(m.store, m.generation, m.rank, m.world, m.timeout_s, release=[old_ctx])
    rebuild(trainer, context_for(trainer.cfg))
    moved = move_state(trainer.ctx, old, state_items(trainer.chunks, trainer.optimizer))
    got = trainer.ctx.world.all_gather_object(handover)
    steps = {r: h["progress"]["iteration"] for r, h in enumerate(got) if h is not None}
    if len(set(steps.values())) != 1:
        raise ReplaceFailed(f"the survivors hold different steps after rank {record['dead']} died: {steps}")
    trainer.boundary_pending = pending_boundary(got)
    trainer.adopt(handover["scalar"], handover["scheduler"], handover["streams"])
    flight = trainer.ctx.ledger.flight
    if flight is not None:  # the replacement's recorder is attached when its loop starts, after these moves
        flight.restart_counts()
    return moved


def take_over(trainer) -> int:
    """The replacement, its ``Trainer`` built in the new generation: receive the dead rank's state
    from its DP replica and the counts from a survivor; returns the elements received."""
    ctx, m = trainer.ctx, trainer.membership
    trainer.recovered = json.loads(m.store.get(failed_key(m.generation - 1)))
    moved = move_state(ctx, {}, state_items(trainer.chunks, trainer.optimizer))
    got = ctx.world.all_gather_object(None)
    me = ctx.grid.coords(ctx.rank)
    src = next(h for h in got if h is not None and _same_place(h["coords"], me))
    trainer.restore_progress(src["progress"])
    trainer.microbatch_time, trainer.measure_step = src["microbatch_time"]
    trainer.state.dp_microbatches = src["dp_microbatches"]
    trainer.boundary_pending = pending_boundary(got)
    trainer.adopt(src["scalar"], src["scheduler"], src["streams"])
    trainer.handed_step_record = src["last_step"]  # rank 0's line of that step may be missing
    return moved


def let_go(trainer, exc: BaseException) -> None:
    """Drop every reference to the old process groups: gloo closes a group's connections (which
    wakes the peers blocked on them) only when nothing holds it any more; seen with torch 2.13,
    where a survivor waited on this rank's DP all-reduce until the timeout while the failed
    step's frames (in ``exc``'s traceback) and the DDP buckets' reductions in flight held it."""
    traceback.clear_frames(exc.__traceback__)
    release_context(trainer.ctx)
    for states in getattr(trainer.ddp, "_states", []):  # each bucket's reduction in flight
        for st in states:
            st.handle = None
    gc.collect()


def recover(trainer, exc: BaseException) -> bool:
    """After ``exc`` ended a step: True when it was a rank's death and this survivor went on in
    the next generation (the step is redone); False when ``exc`` is to be raised (no membership,
    or no failure record came within :data:`FAILURE_WAIT_S`)."""
    m = trainer.membership
    if m is None:
        return False
    let_go(trainer, exc)
    abort_world()  # peers blocked on this rank fail now instead of at their timeout
    record = m.failure(min(m.timeout_s, FAILURE_WAIT_S))
    if record is None:
        return False
    if record["mode"] != "replace":  # the launcher ends every rank and restarts from the checkpoint
        log(trainer.ctx, f"rank {record['dead']} died: {record['reason']}; the launcher restarts the job")
        time.sleep(m.timeout_s)
        return False
    t0 = time.perf_counter()
    moved = rejoin(trainer, record)
    trainer.recovered = dict(record, rejoin_s=time.perf_counter() - t0)
    log(trainer.ctx, f"rank {record['dead']} died ({record['reason']}): replaced in place, generation "
                     f"{m.generation}, going on from iteration {trainer.state.iteration} "
                     f"({time.perf_counter() - t0:.2f} s to regroup; {moved:,} elements received here)")
    return True
