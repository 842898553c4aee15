"""Play one rank of an N-rank world on one CPU: torch's fake process group, meta tensors.

:func:`rehearse_rank` joins a ``"fake"`` world (``torch.testing._internal.distributed.fake_pg``:
every collective and p2p returns at once, moving nothing) as rank ``r`` of ``N``, builds the
parallel context, the model chunks, DDP / ZeRO buffers and optimizer through the same builders as
``paratron train`` with every tensor on the ``meta`` device (shapes and dtypes, no storage), and
runs one whole step through the pipeline runtime and the optimizer (:func:`.measure.measure_step`).

What a meta tensor cannot serve, and what stands in for it (the only seams in the real code):

* the optimizer's one host read (grad norm, non-finite flag, loss): ``Optimizer.host_values``
  returns zeros, so the step is taken as finite with no clipping;
* MoE routing is data dependent: the routed token counts per expert are taken as balanced
  (``tokens x top_k / experts`` each), see :func:`balanced_routing`;
* the tokens are zeros of the right shape (``[micro_batch_size, seq_length]``, the CP share).

So a dry run proves shapes, divisibility, groups, schedules, buffer sizes, activation bytes and
communication volumes; it says nothing of kernel speed, NCCL behaviour, numerics or routing
imbalance.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from paratron.dryrun.measure import measure_step

META = torch.device("meta")


class DryRunError(RuntimeError):
    """A layout that would fail at launch, found by the dry run; the message names the rank."""


@contextmanager
def fake_world(rank: int, world_size: int):
    """A fake process group of ``world_size`` ranks, this process being ``rank`` (destroyed on exit)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _no_host_values(t: torch.Tensor) -> list[float]:
    """What the optimizer reads back on meta: zeros (finite, no clipping)."""
    return [0.0] * t.numel()


def synthetic_microbatches(cfg, ctx) -> list[dict]:
    """This DP rank's microbatches of one global batch: zero tokens and labels ``[b, s]`` on meta,
    then this CP rank's share (the data pipeline's own preparer)."""
    from paratron.training.data_iter import microbatch_preparer

    t = cfg.train
    per_dp = t.global_batch_size // ctx.dp.size
    m = per_dp // t.micro_batch_size
    prepare = microbatch_preparer(cfg, ctx, eod=0)
    shape = (t.micro_batch_size, cfg.model.seq_length)
    return [prepare({"tokens": torch.zeros(shape, dtype=torch.long, device=META),
                     "labels": torch.zeros(shape, dtype=torch.long, device=META)}) for _ in range(m)]


def build_rank(cfg, ctx):
    """Model chunks, DDP and optimizer of this rank on meta (``paratron train``'s builder)."""
    from paratron.training.setup import build_model_and_optimizer, seed_everything

    seed_everything(cfg.train.seed, ctx)
    with torch.device(META):
        chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    optimizer.host_values = _no_host_values
    return chunks, ddp, optimizer


def build_context(cfg, device):
    """The run's parallel context, with only the groups ``paratron train`` would create."""
    from paratron.parallel.context import ParallelContext
    from paratron.training.groups import groups_used

    p = cfg.parallel
    return ParallelContext.build(tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                                 expert_tp=p.expert_tensor, order=p.order, kinds=groups_used(cfg),
                                 device=device)


def rehearse_rank(cfg, world_size: int, rank: int) -> dict:
    """One step of ``cfg`` as ``rank`` of ``world_size``, on meta; returns the rank's
    :class:`~.measure.StepMeasure` as a dict (plus ``rank`` and its grid coordinates).

    Raises:
        DryRunError: anything the real run would hit on this rank (a shape or divisibility
            error, a group never created, a schedule the validator rejects), naming the rank.
    """
    from paratron.training.step import rank_actions

    with fake_world(rank, world_size):
        try:
            ctx = build_context(cfg, META)
            chunks, ddp, optimizer = build_rank(cfg, ctx)
            microbatches = synthetic_microbatches(cfg, ctx)
            actions = rank_actions(cfg, ctx, len(microbatches))
            with balanced_routing(chunks):
                measure = measure_step(cfg, ctx, chunks, ddp, optimizer, microbatches, actions)
        except DryRunError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one line naming the rank
            raise DryRunError(f"rank {rank}: {type(exc).__name__}: {exc}") from exc
        out = {"rank": rank, "coords": ctx.grid.coords(rank), **measure.as_dict()}
    return out


@contextmanager
def balanced_routing(chunks):
    """Stand-in for data-dependent MoE routing on meta: nothing to do for dense models."""
    yield
