"""The sequence-level load-balancing loss of DeepSeek-V2 (DeepSeek-AI 2024, section 2.2.1,
"expert-level balance loss" computed per sequence; DeepSeek-V3 section 2.1.2, equations 17-20):

    L_seq = E * sum_e f_e P_e,   f_e = count_e / (k L),   P_e = (1 / L) sum_t p_{t,e}

over the ``L`` tokens of one sequence (a sample, or one packed document of a sample). The step
averages ``L_seq`` over every sequence of the global batch (:func:`count_global_sequences`), so
the value and its grads do not depend on the micro-batch size, nor on how TP+SP or CP split a
sequence's tokens: each rank adds its tokens' counts and probabilities per sequence, the counts
are summed over the ranks that share the microbatch, and each rank's differentiable share uses its
own probabilities.
"""

from __future__ import annotations

import torch

from paratron.parallel.context import ParallelContext


def sequence_balance_loss(balance_probs: torch.Tensor, indices: torch.Tensor, segment_ids: torch.Tensor,
                          lengths: torch.Tensor, stats_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's differentiable share of ``sum over sequences of L_seq``, and the whole sum.

    Args:
        balance_probs: ``[T, E]`` router probabilities of this rank's tokens (differentiable).
        indices: ``[T, k]`` chosen experts (before any capacity drop).
        segment_ids: ``[T]`` sequence index of each token (0 .. n-1, same numbering on every rank).
        lengths: ``[n]`` tokens of each sequence (all ranks together).
        stats_group: the group whose ranks hold the other tokens of these sequences, or None.
    Returns:
        ``(share, total)``: the shares of the group's ranks sum to ``total`` (detached).
    """
    T, E = balance_probs.shape
    k = indices.shape[1]
    n = lengths.numel()
    counts = torch.zeros(n, E, dtype=torch.float32, device=indices.device)
    counts.index_put_((segment_ids.unsqueeze(1).expand(T, k), indices),
                      torch.ones(T, k, dtype=torch.float32, device=indices.device), accumulate=True)
    probs = torch.zeros(n, E, dtype=balance_probs.dtype, device=balance_probs.device).index_add(
        0, segment_ids, balance_probs)
    stats = torch.stack([counts, probs.detach()])
    if stats_group is not None and stats_group.size > 1:
        stats_group.all_reduce(stats)
    coef = E / (k * lengths.to(torch.float32).square())  # [n]
    share = (coef.unsqueeze(1) * stats[0] * probs).sum()
    total = (coef.unsqueeze(1) * stats[0] * stats[1]).sum()
    return share, total.detach()


def count_sequences(mb: dict) -> int:
    """Sequences of a microbatch: its samples, or its non-empty packed documents (``cu_seqlens``)."""
    cu = mb.get("cu_seqlens")
    if cu is None:
        return int(mb["tokens"].shape[0])
    return int(((cu[:, 1:] - cu[:, :-1]) > 0).sum())


def count_global_sequences(microbatches: list[dict], ctx: ParallelContext) -> float:
    """Sequences in the global batch: this rank's microbatches summed over DP (CP ranks hold parts
    of the same sequences, so not over CP). Counted from host metadata and summed on the host
    side of the DP group: no device work and no device sync."""
    t = torch.tensor([float(sum(count_sequences(mb) for mb in microbatches))], dtype=torch.float64)
    ctx.dp.host_all_reduce(t)
    return max(float(t[0]), 1.0)
