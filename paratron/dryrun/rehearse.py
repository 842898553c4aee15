"""Play one rank of an N-rank world on one CPU: torch's fake process group, meta tensors.

:func:`rehearse_rank` joins a ``"fake"`` world (``torch.testing._internal.distributed.fake_pg``:
every collective and p2p returns at once, moving nothing) as rank ``r`` of ``N``, builds the
parallel context, the model chunks, DDP / ZeRO buffers and optimizer through the same builders as
``paratron train`` with every tensor on the ``meta`` device (shapes and dtypes, no storage), and
runs one whole step through the pipeline runtime and the optimizer (:func:`.measure.measure_step`).

What a meta tensor cannot serve, and what stands in for it (the only seams in the real code):

* the optimizer's one host read (grad norm, non-finite flag, loss): ``Optimizer.host_values``
  returns zeros, so the step is taken as finite with no clipping;
* the attention core on meta takes torch's flash op (``models/attention.py``): SDPA's backend
  choice has no meta entry and would take the math path, which a real run does not;
* MoE routing is data dependent (token counts per expert decide tensor sizes): the dry run
  routes by a fixed balanced rule (:mod:`.moe_standin`), so the MoE figures are those of a
  perfectly balanced step; layouts that read the routing again (capacity dropping, expert TP,
  the all-gather dispatcher) are refused, naming the field;
* the tokens are zeros of the right shape (``[micro_batch_size, seq_length]``, the CP share).

So a dry run proves shapes, divisibility, groups, schedules, buffer sizes, activation bytes and
communication volumes; it says nothing of kernel speed, NCCL behaviour, numerics or routing
imbalance.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from paratron.dryrun.measure import measure_step, model_state
from paratron.dryrun.moe_standin import check_supported, install_balanced_routing
from paratron.parallel.context import ParallelContext
from paratron.training.builders import build_model_and_optimizer, seed_everything
from paratron.training.data_iter import microbatch_preparer
from paratron.training.groups import groups_used
from paratron.training.step import rank_actions

META = torch.device("meta")
GB = 1e9
TERMS = ("params", "grads", "main_params", "optimizer_state", "peak_activations")


class DryRunError(ValueError):
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
    t = cfg.train
    per_dp = t.global_batch_size // ctx.dp.size
    m = per_dp // t.micro_batch_size
    prepare = microbatch_preparer(cfg, ctx, eod=0)
    shape = (t.micro_batch_size, cfg.model.seq_length)
    return [prepare({"tokens": torch.zeros(shape, dtype=torch.long, device=META),
                     "labels": torch.zeros(shape, dtype=torch.long, device=META)}) for _ in range(m)]


def build_rank(cfg, ctx):
    """Model chunks, DDP and optimizer of this rank on meta (``paratron train``'s builder)."""
    seed_everything(cfg.train.seed, ctx)
    with torch.device(META):
        chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    optimizer.host_values = _no_host_values
    return chunks, ddp, optimizer


def build_context(cfg, device):
    """The run's parallel context, with only the groups ``paratron train`` would create."""
    p = cfg.parallel
    return ParallelContext.build(tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                                 expert_tp=p.expert_tensor, order=p.order, kinds=groups_used(cfg),
                                 device=device)


def check_memory(row: dict, memory_gb: float) -> None:
    """Refuse a rank whose model states plus peak activations exceed ``memory_gb``, naming the
    rank and the largest term (a single term over the limit is named as such).

    Raises:
        DryRunError: the rank does not fit.
    """
    limit = memory_gb * GB
    terms = {t: row[t] for t in TERMS if t in row}
    total = sum(terms.values())
    if total <= limit:
        return
    big = max(terms, key=terms.get)
    where = f"rank {row['rank']} (pipeline stage {row['coords']['pp']})"
    parts = ", ".join(f"{t} {v / GB:.2f}" for t, v in terms.items())
    alone = " alone" if terms[big] > limit else ""
    raise DryRunError(f"{where} needs {total / GB:.2f} GB > --memory-gb {memory_gb:g}: {big} "
                      f"({terms[big] / GB:.2f} GB){alone} overflows [{parts} GB]")


def rehearse_rank(cfg, world_size: int, rank: int, memory_gb: float | None = None) -> dict:
    """One step of ``cfg`` as ``rank`` of ``world_size``, on meta; returns the rank's
    :class:`~.measure.StepMeasure` as a dict (plus ``rank`` and its grid coordinates).

    Raises:
        DryRunError: anything the real run would hit on this rank (a shape or divisibility
            error, a group never created, a schedule the validator rejects), naming the rank;
            with ``memory_gb``, a rank that does not fit (:func:`check_memory`; model states are
            checked before the step, with the activations after it).
    """
    if cfg.model.num_experts > 0 and (why := check_supported(cfg)):
        raise DryRunError(f"rank {rank}: the dry run routes MoE tokens by a balanced stand-in, which cannot "
                          f"serve {why}")
    with fake_world(rank, world_size):
        try:
            ctx = build_context(cfg, META)
            chunks, ddp, optimizer = build_rank(cfg, ctx)
            install_balanced_routing(chunks, meta=True)
            if memory_gb is not None:  # model states alone over the limit: refused before the step
                check_memory({"rank": rank, "coords": ctx.grid.coords(rank), **model_state(ddp, optimizer)},
                             memory_gb)
            microbatches = synthetic_microbatches(cfg, ctx)
            actions = rank_actions(cfg, ctx, len(microbatches))
            measure = measure_step(cfg, ctx, chunks, ddp, optimizer, microbatches, actions)
        except DryRunError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported as one line naming the rank
            raise DryRunError(f"rank {rank}: {type(exc).__name__}: {exc}") from exc
        out = {"rank": rank, "coords": ctx.grid.coords(rank), **measure.as_dict()}
    if memory_gb is not None:
        check_memory(out, memory_gb)
    return out
