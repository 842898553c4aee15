"""A spare process joining a running job at a pipeline grow (:mod:`paratron.elastic.regrid`).

The launcher starts ``train.elastic_spares`` processes beside the training world. Each stands by
(:func:`stand_by`: it polls its key in the launch's store, holding no process group) until rank 0
calls it in at a grow, or tells it the job ended (it then exits 0 without training). Called in, it
meets the training ranks in the new generation's default group, builds its whole
:class:`~paratron.training.trainer.Trainer` at the new grid, receives its params and optimizer
state point-to-point from their old owners and the counts from rank 0, and trains on from the
next step.
"""

from __future__ import annotations

import signal

from paratron.checkpoint import rng
from paratron.elastic.regrid import ElasticSession, UnionGroup, mover, remake_world, wait_for_call
from paratron.elastic.relayout import move_state, state_items
from paratron.training.groups import context_for
from paratron.training.trainer import Trainer


def stand_by(session: ElasticSession, run_dir, clock, builtin_callbacks=None) -> int:
    """A spare: wait to be called in, then :func:`join`; 0 when the job ended without it, or
    when a stop (SIGTERM/SIGINT, which the launcher sends every rank) came while it stood by: it
    holds no state to save, and dying of the signal would read as the job's failure."""
    def leave(signum, frame):
        raise SystemExit(0)

    previous = {sig: signal.signal(sig, leave) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        call = wait_for_call(session)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if call is None else join(session, call, run_dir, clock, builtin_callbacks)


def join(session: ElasticSession, call: dict, run_dir, clock, builtin_callbacks=None) -> int:
    """Join the job at the grid of ``call`` (rank 0's call, :func:`~paratron.elastic.regrid.change_pipeline`)
    and train to its end; returns the exit code. The collectives mirror a survivor's
    ``change_pipeline``: the union group, the new default group and context, the trainer's
    builders (``Trainer.__init__`` against :func:`~paratron.elastic.regrid.rebuild`), the moves,
    rank 0's counts."""
    cfg, gen = call["config"], call["generation"]
    union = UnionGroup(session, gen, call["rank"], call["union_size"])
    remake_world(session, gen, call["rank"], call["world"])
    session.spares = list(call["spares"])
    trainer = Trainer(cfg, context_for(cfg), run_dir, clock, builtin_callbacks)
    trainer.elastic = session
    move_state(mover(union, call["stages"]), {}, state_items(trainer.chunks, trainer.optimizer))
    carry = next(c for c in union.all_gather_object(None) if c is not None)
    trainer.restore_progress(carry["progress"])
    trainer.microbatch_time, trainer.measure_step = carry["microbatch_time"]
    trainer.state.dp_microbatches = carry["dp_microbatches"]
    trainer.adopt(carry["scalar"], carry["scheduler"], None)
    rng.rederive(trainer.chunks, trainer.ctx, cfg.train.seed, trainer.state.iteration)  # as a resume at a new layout
    clock.reported = True  # the job's start-up record was written before this process joined
    return trainer.train(joined=True)
