"""Completing the grads of one step before the optimizer, in Megatron's order of concerns
(``finalize_model_grads``): model-parallel all-reduces of replicated params, then the DP
reduction.

Sequence-parallel params (norm weights, row-parallel biases) hold partial grads on each TP rank
and are summed over TP (Korthikanti et al. 2022, section 4.2.2); tied embedding copies on the
first and last pipeline stage are summed over the embedding group (Narayanan et al. 2021). DDP
keeps these params in deferred buckets that are not reduced during backward, so both all-reduces
act on the local (not yet DP-reduced) main grads; the DP reduction of those buckets then starts
and every reduction is waited for.
"""

from __future__ import annotations

from ..parallel.grads import allreduce_embedding_grads, allreduce_sequence_parallel_grads


def finalize_grads(chunks, ctx, ddp) -> None:
    """Model-parallel grad all-reduces, then DP: afterwards the main grads (or ZeRO-1 shard
    grads) of every param are the sums over every rank that computed a part of them.

    Args:
        chunks: the model chunks (unused beyond documentation of the call site; the params come
            from ``ddp``, which was built from the same chunks).
        ctx: the parallel context.
        ddp: the :class:`~paratron.optim.ddp.DistributedDataParallel` of ``chunks``.
    """
    params = ddp.params
    allreduce_sequence_parallel_grads(params, ctx)
    allreduce_embedding_grads(params, ctx)
    ddp.finish_grad_sync()
