"""``run_training``: ``paratron train`` on every rank.

Flow: parallel context → :class:`~paratron.training.trainer.Trainer` (data → model chunks →
DDP + optimizer + LR schedule → checkpoints, evaluator, logging) → ``Trainer.train()`` (resume,
then the loop). A run stopped by the non-finite policy exits with code 1 after one line naming
the step; the last checkpoint is left as it was.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.config import Config
from paratron.launch.grow import stand_by
from paratron.elastic.regrid import release_spares, start_session
from paratron.elastic.replace import join_world
from paratron.training.replace_step import take_over
from paratron.launch.rankproc import record_failure
from paratron.launch.startup import StartupClock
from paratron.launch.watchdog import HangWatchdog
from paratron.parallel.context import init_distributed
from paratron.training.groups import context_for
from paratron.training.host_memory import keep_host_memory_if_cpu
from paratron.training.step_log import log
from paratron.training.trainer import NonFiniteStop, Trainer


def build_context(cfg: Config):
    init_distributed(cfg.parallel.timeout_s)
    return context_for(cfg)


def builtin_callbacks(cfg: Config, ctx, state) -> list:
    """The hang watchdog (first, so it sees every step of the other callbacks), when on."""
    if cfg.parallel.hang_timeout_s > 0 and ctx.world_size > 1:
        return [HangWatchdog(state, cfg.parallel.hang_timeout_s,
                             check_collectives=cfg.parallel.check_collectives)]
    return []


def replace_rank(trainer: Trainer) -> int:
    """A replacement process: take over the dead rank's state from its DP replica, then train
    on from the survivors' step (:func:`paratron.elastic.replace.take_over`)."""
    t0 = time.perf_counter()
    moved = take_over(trainer)
    trainer.recovered["rejoin_s"] = time.perf_counter() - t0  # a replaced rank 0's record: its side of the regroup
    trainer.membership.mark_ready()
    trainer.writer.start(trainer.state.iteration)  # rank 0: lines after the step go to the superseded file
    last = trainer.handed_step_record
    if last is not None and last.get("iteration") == trainer.state.iteration:
        trainer.writer.write_if_missing(last)  # a rank 0 dead after the step's commit point, before its line
    trainer.clock.reported = True  # the job's start-up record was written before this process joined
    log(trainer.ctx, f"rank {trainer.ctx.rank} replaced: {moved:,} elements of params and optimizer state "
                     f"received, going on from iteration {trainer.state.iteration}")
    return trainer.train(joined=True)


def run_training(cfg: Config, run_dir: str | None = None) -> int:
    """Train as configured; returns a process exit code (0, or 1 after a non-finite stop).
    Call on every rank (under torchrun)."""
    run_dir = Path(run_dir or os.environ.get("PARATRON_RUN_DIR") or "runs/latest")
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    keep_host_memory_if_cpu(cfg.train.keep_host_memory)
    clock = StartupClock()
    with clock.part("rendezvous"):
        membership = join_world(cfg)  # under the elastic launcher (train.replace_dead_ranks)
        init_distributed(cfg.parallel.timeout_s)
        session = start_session(cfg)  # elastic runs; the spares leave the default group
        ctx = build_context(cfg) if dist.is_initialized() else None
    try:
        if ctx is None:  # a spare: stands by until a pipeline grow calls it in
            return stand_by(session, run_dir, clock, lambda state: builtin_callbacks(cfg, state.ctx, state))
        trainer = Trainer(cfg, ctx, run_dir, clock, lambda state: builtin_callbacks(cfg, state.ctx, state))
        trainer.elastic, trainer.membership = session, membership
        if cfg.train.replace_dead_ranks and membership is None:
            log(ctx, "warning: train.replace_dead_ranks=true needs paratron's launcher (paratron train "
                     "--nproc-per-node N): a dead rank ends this job")
        if membership is not None and membership.replaces:
            return replace_rank(trainer)
        if membership is not None:
            membership.mark_ready()
        return trainer.train()
    except NonFiniteStop as exc:
        if ctx is not None:
            log(ctx, f"error: {exc}")
        record_failure(exc)
        return 1
    finally:
        if dist.is_initialized():
            release_spares(session, dist.get_rank())  # rank 0: the spares never called in exit 0
            dist.destroy_process_group()
