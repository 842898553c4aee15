"""Completing the grads of one step before the optimizer, in Megatron's order of concerns
(``finalize_model_grads``): model-parallel all-reduces of replicated params, then the DP
reduction. This is the one place where those all-reduces happen; the training step calls it once
per step, after the last backward, and :meth:`paratron.optim.optimizer.Optimizer.step` only
updates (it refuses grads that were not finalized).

Sequence-parallel params (norm weights, row-parallel biases) hold partial grads on each TP rank
and are summed over TP (Korthikanti et al. 2022, section 4.2.2); tied embedding copies on the
first and last pipeline stage are summed over the embedding group (Narayanan et al. 2021). DDP
keeps these params in deferred buckets that are not reduced during backward, so both all-reduces
act on the local (not yet DP-reduced) main grads; the DP reduction of those buckets then starts
and every reduction is waited for.
"""

from __future__ import annotations

from ..parallel.context import ParallelContext
from ..parallel.grads import allreduce_embedding_grads, allreduce_sequence_parallel_grads
from ..parallel.params import meta_of, unique_params


def finalize_grads(chunks, ctx: ParallelContext, ddp=None) -> None:
    """Model-parallel grad all-reduces, then DP: afterwards the main grads (or ZeRO-1 shard
    grads) of every param are the sums over every rank that computed a part of them.

    With ``ddp`` a second call in the same step does nothing (DDP knows the step's grads are
    final until its next ``zero_grad_buffer``). Without ``ddp`` (plain ``.grad`` params, no data
    parallelism: tests and tools) only the model-parallel all-reduces run, once per call.

    Args:
        chunks: this rank's model chunks (the params come from ``ddp`` when given, which was
            built from the same chunks).
        ctx: the parallel context.
        ddp: the :class:`~paratron.optim.ddp.DistributedDataParallel` of ``chunks``, or None.

    Raises:
        ValueError: ``ddp`` is None but the chunks' params have DDP main grads (pass the DDP:
            reducing them without it would sum the model-parallel grads twice).
    """
    if ddp is not None and ddp.finalized:
        return
    params = ddp.params if ddp is not None else unique_params(chunks, trainable_only=True)
    if ddp is None and any(meta_of(p).main_grad is not None for p in params):
        raise ValueError("finalize_grads: these chunks are wrapped by DistributedDataParallel; "
                         "pass it as ddp= (its buffers hold the grads)")
    allreduce_sequence_parallel_grads(params, ctx)
    allreduce_embedding_grads(params, ctx)
    if ddp is not None:
        ddp.finish_grad_sync()
