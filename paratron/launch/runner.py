"""``run_training``: ``paratron train`` on every rank.

Flow: parallel context → :class:`~paratron.training.trainer.Trainer` (data → model chunks →
DDP + optimizer + LR schedule → checkpoints, evaluator, logging) → ``Trainer.train()`` (resume,
then the loop). A run stopped by the non-finite policy exits with code 1 after one line naming
the step; the last checkpoint is left as it was.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.config import Config
from paratron.launch.rankproc import record_failure
from paratron.launch.startup import StartupClock
from paratron.launch.watchdog import HangWatchdog
from paratron.parallel.context import ParallelContext, init_distributed
from paratron.training.groups import groups_used
from paratron.training.step_log import log
from paratron.training.trainer import NonFiniteStop, Trainer


def build_context(cfg: Config):
    init_distributed(cfg.parallel.timeout_s)
    p = cfg.parallel
    return ParallelContext.build(tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                                 expert_tp=p.expert_tensor, order=p.order, kinds=groups_used(cfg))


def builtin_callbacks(cfg: Config, ctx, state) -> list:
    """The hang watchdog (first, so it sees every step of the other callbacks), when on."""
    if cfg.parallel.hang_timeout_s > 0 and ctx.world_size > 1:
        return [HangWatchdog(state, cfg.parallel.hang_timeout_s,
                             check_collectives=cfg.parallel.check_collectives)]
    return []


def run_training(cfg: Config, run_dir: str | None = None) -> int:
    """Train as configured; returns a process exit code (0, or 1 after a non-finite stop).
    Call on every rank (under torchrun)."""
    run_dir = Path(run_dir or os.environ.get("PARATRON_RUN_DIR") or "runs/latest")
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    clock = StartupClock()
    with clock.part("rendezvous"):
        ctx = build_context(cfg)
    try:
        return Trainer(cfg, ctx, run_dir, clock, lambda state: builtin_callbacks(cfg, ctx, state)).train()
    except NonFiniteStop as exc:
        log(ctx, f"error: {exc}")
        record_failure(exc)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
