"""Top-k router: scores, expert choice with deterministic ties, the load-balancing aux loss, the
router z-loss, and the capacity limit (token dropping).

Layout: the router sees the tokens of one rank as rows, ``[T, h]`` (the ``[s, b, h]``
activations flattened sequence-major: row ``t = s_idx * b + b_idx``).

Sources:

* top-k gating and capacity: Shazeer et al. 2017 (section 2.1); Lepikhin et al. 2020, GShard
  (section 2.2, algorithm 1); Fedus et al. 2021, Switch Transformers (section 2.2, capacity factor).
* aux loss: Switch Transformers (section 2.2, equation 4): ``E * sum_e f_e * P_e``, ``f_e`` the
  fraction of routed (token, slot) pairs sent to expert ``e``, ``P_e`` the mean router probability
  of ``e``. A perfectly balanced router scores 1.
* z-loss: Zoph et al. 2022, ST-MoE (section 3.1, equation 5): ``mean_t logsumexp(logits_t)^2``.
* normalised top-k probabilities (k > 1): Mixtral (Jiang et al. 2024, section 2.1: softmax over
  the top-k logits, which equals the renormalised top-k of the full softmax); sigmoid scores
  normalised over the chosen experts: DeepSeek-V3 (Liu et al. 2024, section 2.1.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig
from paratron.layers.init import init_shard_, normal_
from paratron.parallel.comm import Group
from paratron.parallel.params import ShardSpec, mark

from .seq_aux import sequence_balance_loss


@dataclass
class Routing:
    """One rank's routing decision for its ``T`` tokens.

    Attributes:
        probs: ``[T, k]`` combine weights of the chosen experts (fp32, differentiable).
        indices: ``[T, k]`` int64 expert ids, best first; ties go to the lowest expert id.
        aux_loss: this rank's differentiable share of the microbatch aux loss (the shares of the
            ranks in the stats group sum to the microbatch value).
        z_loss: this rank's differentiable share of the microbatch z-loss.
        aux_value: the whole microbatch's aux loss (detached scalar), for the training log.
        z_value: the whole microbatch's z-loss (detached scalar).
        counts_before: ``[E]`` (token, slot) pairs routed to each expert by the ranks of the stats
            group that come before this one (float; exact integers), for capacity positions.
        num_tokens: tokens of the whole microbatch (all ranks of the stats group).
    """

    probs: torch.Tensor
    indices: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    aux_value: torch.Tensor
    z_value: torch.Tensor
    counts_before: torch.Tensor
    num_tokens: int


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best experts per row of ``scores`` [T, E]; equal scores go to the lowest id.

    A stable descending sort keeps equal scores in index order, so the choice is exact and the
    same on every rank and in a recompute (``torch.topk`` makes no promise about ties).

    Returns:
        ``(values [T, k], indices [T, k] int64)``.
    """
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


class TopKRouter(nn.Module):
    """Linear gate ``[T, h] -> [T, E]`` logits, then top-k choice and the auxiliary losses.

    The weight ``[E, h]`` (logical name ``layers.{i}.mlp.router.weight``) is replicated over
    every rank. Under sequence parallelism each TP rank routes different tokens, so the weight is
    marked ``sequence_parallel`` and its grads are summed over TP by
    :func:`paratron.parallel.grads.allreduce_sequence_parallel_grads`; without it every TP rank
    routes the same tokens and computes the same grads.

    Logits and scores are computed in fp32 whatever ``params_dtype`` is (routing decisions are
    sensitive to rounding).

    Args:
        cfg: ``num_experts``, ``moe_top_k``, ``moe_router_score``, ``hidden_size``,
            ``init_method_std``.
        ctx: the parallel context (device).
        logical_name: e.g. ``layers.0.mlp.router``.
        seed: the run's seed.
        sequence_parallel: whether tokens are split over TP (see above).
        params_dtype: parameter dtype.
    """

    def __init__(self, cfg: ModelConfig, ctx, *, logical_name: str, seed: int, sequence_parallel: bool,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts, self.k, self.score = cfg.num_experts, cfg.moe_top_k, cfg.moe_router_score
        shape = (cfg.num_experts, cfg.hidden_size)
        weight = torch.empty(shape, device=ctx.device, dtype=params_dtype)
        self.weight = nn.Parameter(init_shard_(weight, normal_(cfg.init_method_std), ShardSpec.replicated(shape),
                                               seed, f"{logical_name}.weight"))
        mark(self.weight, f"{logical_name}.weight", sequence_parallel=sequence_parallel)

    def forward(self, tokens: torch.Tensor, stats_group: Group | None = None,
                segments: tuple[torch.Tensor, torch.Tensor] | None = None) -> Routing:
        """Route ``tokens`` [T, h].

        Args:
            stats_group: the group whose ranks together hold one microbatch (the TP group under
                sequence parallelism), or None when this rank holds all of it. The per-expert
                counts and probability sums are all-gathered over it (one collective of
                ``2E + 1`` floats), so the aux loss and capacity positions are those of the whole
                microbatch whatever the layout.
            segments: ``(segment_ids [T], lengths [n])`` for the sequence-level aux loss
                (``model.moe_aux_loss_type = "seq"``, :mod:`.seq_aux`): ``aux_loss`` is then this
                rank's share of the *sum* over the microbatch's sequences, ``aux_value`` their mean.
        """
        logits = F.linear(tokens.float(), self.weight.float())  # [T, E]
        if self.score == "softmax":
            scores = torch.softmax(logits, dim=-1)
            balance_probs = scores
        else:
            scores = torch.sigmoid(logits)
            balance_probs = scores / scores.sum(dim=-1, keepdim=True)
        chosen, indices = top_k(scores, self.k)
        # Renormalise only for k > 1: with k = 1 the weight would be exactly 1 and the router
        # would get no gradient from the LM loss (Switch keeps the raw probability).
        probs = chosen / chosen.sum(dim=-1, keepdim=True) if self.k > 1 else chosen

        E, T = self.num_experts, tokens.shape[0]
        counts = torch.bincount(indices.reshape(-1), minlength=E).to(torch.float32)
        prob_sum = balance_probs.sum(dim=0)  # [E], differentiable
        lse_sq = torch.logsumexp(logits, dim=-1).square().sum()  # differentiable
        stats = torch.cat([counts, prob_sum.detach(), lse_sq.detach().reshape(1)])
        if stats_group is not None and stats_group.size > 1:
            every = stats_group.all_gather(stats.reshape(1, -1), 0)  # [g, 2E+1]
            r = stats_group.rank
        else:
            every, r = stats.reshape(1, -1), 0
        total = every.sum(dim=0)
        n_tokens = T * every.shape[0]
        counts_all, prob_all, lse_all = total[:E], total[E:2 * E], total[2 * E]
        # Switch eq. 4 with f_e = counts_e / (N k) and P_e = prob_sum_e / N; this rank's share
        # uses its own prob sums (the differentiable part) against the microbatch counts.
        scale = E / (n_tokens * n_tokens * self.k)
        aux_loss = scale * (counts_all * prob_sum).sum()
        aux_value = (scale * (counts_all * prob_all).sum()).detach()
        if segments is not None:
            aux_loss, aux_sum = sequence_balance_loss(balance_probs, indices, *segments, stats_group)
            aux_value = aux_sum / segments[1].numel()
        z_loss = lse_sq / n_tokens
        return Routing(
            probs=probs, indices=indices, aux_loss=aux_loss, z_loss=z_loss,
            aux_value=aux_value,
            z_value=(lse_all / n_tokens).detach(),
            counts_before=every[:r, :E].sum(dim=0), num_tokens=n_tokens)


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per microbatch: ``ceil(capacity_factor * num_tokens * top_k / num_experts)``
    (Switch Transformers, section 2.2, with GShard's k slots per token).

    Raises:
        ValueError: ``capacity_factor <= 0`` (field ``model.moe_capacity_factor``).
    """
    if capacity_factor <= 0:
        raise ValueError(f"model.moe_capacity_factor={capacity_factor} must be > 0 (or unset: dropless)")
    return int(math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def drop_over_capacity(indices: torch.Tensor, capacity: int, counts_before: torch.Tensor) -> torch.Tensor:
    """Mark (token, slot) pairs beyond an expert's capacity as dropped (expert id -1).

    Priority is by position in the microbatch: earlier tokens first, then lower slots; the pairs
    held by earlier ranks of the stats group come first (``counts_before``), so the same pairs
    are dropped under every layout.

    Args:
        indices: ``[T, k]`` chosen expert ids of this rank's tokens.
        capacity: slots per expert (see :func:`expert_capacity`).
        counts_before: ``[E]`` pairs routed to each expert by earlier ranks.

    Returns:
        ``[T, k]`` int64, the kept expert ids and -1 where dropped.
    """
    flat = indices.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    sorted_e = flat[order]
    counts = torch.bincount(flat, minlength=counts_before.numel())
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[sorted_e]
    position = position + counts_before.to(torch.int64)[flat]
    return torch.where(position < capacity, flat, torch.full_like(flat, -1)).view_as(indices)
