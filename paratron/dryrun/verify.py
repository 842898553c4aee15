"""``paratron plan --verify``: the dry run of the planner's top plans, beside its memory prediction.

Each plan's config (:func:`paratron.planner.layout.to_config`) is rehearsed on the ranks that
differ (:func:`~paratron.dryrun.run.auto_ranks`). The global batch is cut to at most ``pp x vpp``
microbatches per pipeline, where every schedule paratron has reaches its peak in flight, so that
one step stays short; the planner's figures beside it are for the same cut batch.
"""

from __future__ import annotations

from paratron.rules import validate
from paratron.dryrun.run import auto_ranks, dry_run, table
from paratron.planner.layout import to_config


def plan_config(base, est, prob):
    """The config of plan ``est`` with the global batch cut to ``pp x vpp`` microbatches (or fewer)."""
    lay = est.layout
    m = min(lay.microbatches(prob.global_batch_size), lay.pp * lay.vpp)
    cfg = to_config(base, lay, m * lay.mbs * lay.dp, prob.seq_length, prob.precision)
    cfg.model = prob.model
    cfg.parallel.hang_timeout_s = 0
    validate(cfg, prob.cluster.world)
    return cfg


def verify(base, plans: list, prob, top: int, quiet: bool = False) -> str:
    """The dry-run tables of the first ``top`` plans, each headed by its layout.

    Raises:
        DryRunError: a plan that would fail at launch (naming the rank).
    """
    out = []
    for i, est in enumerate(plans[:top], 1):
        cfg = plan_config(base, est, prob)
        world = prob.cluster.world
        report = dry_run(cfg, world, auto_ranks(cfg, world), quiet=quiet)
        out.append(f"plan {i}: {est.layout.short()} (dry run, global batch cut to {cfg.train.global_batch_size})")
        out.append(table(report))
    return "\n".join(out)
