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
* auxiliary-loss-free balancing: DeepSeek-V3 (Liu et al. 2024, section 2.1.2): a per-expert bias
  ``b_e`` added to the scores for the top-k choice only (the combine weights use the raw scores),
  updated after each step by ``b_e += rate * sign(mean load - load_e)``.
* group-limited (device-limited) routing: DeepSeek-V2 (section 2.2.2) / V3 (section 2.1.2):
  experts in ``G`` groups; a group's score is the sum of its ``k / M`` best expert scores; each
  token chooses among the experts of its ``M`` best groups.
* dropping by score over capacity: Megatron-LM's ``probs`` drop policy; each expert keeps its
  ``capacity`` highest-scoring (token, expert) pairs of the microbatch.
* normalised top-k probabilities (k > 1): Mixtral (Jiang et al. 2024, section 2.1: softmax over
  the top-k logits, which equals the renormalised top-k of the full softmax); sigmoid scores
  normalised over the chosen experts: DeepSeek-V3 (Liu et al. 2024, section 2.1.2).
* routed scaling factor: the combine weights times a constant (DeepSeek-V3's
  ``routed_scaling_factor``, Megatron-Core's ``moe_router_topk_scaling_factor``), after the
  normalisation; the aux losses see the unscaled scores.
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
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import ShardSpec, mark

from .seq_aux import sequence_balance_loss


@dataclass
class Routing:
    """One rank's routing decision for its ``T`` tokens.

    Attributes:
        probs: ``[T, k]`` combine weights of the chosen experts (fp32, differentiable), times
            ``moe_router_topk_scaling_factor`` when set.
        indices: ``[T, k]`` int64 expert ids, best first; ties go to the lowest expert id.
        aux_loss: this rank's differentiable share of the microbatch aux loss (the shares of the
            ranks in the stats group sum to the microbatch value).
        z_loss: this rank's differentiable share of the microbatch z-loss.
        aux_value: the whole microbatch's aux loss (detached scalar), for the training log.
        z_value: the whole microbatch's z-loss (detached scalar).
        counts_before: ``[E]`` (token, slot) pairs routed to each expert by the ranks of the stats
            group that come before this one (float; exact integers), for capacity positions.
        num_tokens: tokens of the whole microbatch (all ranks of the stats group).
        scores: ``[T, k]`` the raw router scores of the chosen experts (detached; no bias, no
            renormalisation), the priority of score-based dropping.
    """

    probs: torch.Tensor
    indices: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    aux_value: torch.Tensor
    z_value: torch.Tensor
    counts_before: torch.Tensor
    num_tokens: int
    scores: torch.Tensor


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best experts per row of ``scores`` [T, E]; equal scores go to the lowest id.

    A stable descending sort keeps equal scores in index order, so the choice is exact and the
    same on every rank and in a recompute (``torch.topk`` makes no promise about ties).

    Returns:
        ``(values [T, k], indices [T, k] int64)``.
    """
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


def limit_to_groups(scores: torch.Tensor, num_groups: int, group_topk: int, k: int) -> torch.Tensor:
    """Group-limited routing: ``scores`` [T, E] with the experts outside each row's
    ``group_topk`` best groups set to -inf. Groups are ``num_groups`` runs of consecutive expert
    ids; a group scores the sum of its ``k // group_topk`` best expert scores (DeepSeek-V3)."""
    T, E = scores.shape
    per_group = scores.view(T, num_groups, E // num_groups)
    group_scores = per_group.topk(k // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    _, best = top_k(group_scores, group_topk)
    keep = torch.zeros(T, num_groups, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    return scores.masked_fill(~keep.repeat_interleave(E // num_groups, dim=1), float("-inf"))


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
        cfg: ``num_experts``, ``moe_top_k``, ``moe_router_score`` (softmax, or DeepSeek-V3's
            sigmoid), ``moe_router_norm_topk_prob``, ``moe_router_topk_scaling_factor``, the expert
            bias and group options, ``hidden_size``, ``init_method_std``.
        ctx: the parallel context (device).
        logical_name: e.g. ``layers.0.mlp.router``.
        seed: the run's seed.
        sequence_parallel: whether tokens are split over TP (see above).
        params_dtype: parameter dtype.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, logical_name: str, seed: int,
                 sequence_parallel: bool,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_experts, self.k, self.score = cfg.num_experts, cfg.moe_top_k, cfg.moe_router_score
        self.norm_topk = cfg.moe_router_norm_topk_prob
        self.scaling_factor = cfg.moe_router_topk_scaling_factor
        shape = (cfg.num_experts, cfg.hidden_size)
        weight = torch.empty(shape, device=ctx.device, dtype=params_dtype)
        self.weight = nn.Parameter(init_shard_(weight, normal_(cfg.init_method_std), ShardSpec.replicated(shape),
                                               seed, f"{logical_name}.weight"))
        mark(self.weight, f"{logical_name}.weight", sequence_parallel=sequence_parallel)
        self.sequence_parallel = sequence_parallel
        self.num_groups, self.group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
        self.bias_update_rate = cfg.moe_router_bias_update_rate
        if cfg.moe_router_enable_expert_bias:
            # A frozen fp32 parameter: no optimizer or DDP touches it (they take trainable params
            # only), and the checkpoint saves and restores it bitwise like any parameter.
            self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts, device=ctx.device), requires_grad=False)
            mark(self.expert_bias, f"{logical_name}.expert_bias")
            self.step_load = torch.zeros(cfg.num_experts, device=ctx.device)
        else:
            self.register_parameter("expert_bias", None)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids ``[T, k]`` for ``scores`` [T, E]: top-k of the scores plus the expert bias,
        within the best groups under group-limited routing (no gradient flows through it)."""
        select = scores.detach()
        if self.expert_bias is not None:
            select = select + self.expert_bias
        if self.num_groups is not None:
            select = limit_to_groups(select, self.num_groups, self.group_topk, self.k)
        return top_k(select, self.k)[1]

    def count_experts(self, indices: torch.Tensor) -> torch.Tensor:
        """(token, slot) pairs per expert ``[E]`` fp32 for ``indices`` ``[T, k]``. The dry run's
        balanced stand-in (:mod:`paratron.dryrun.moe_standin`) replaces it on meta tensors, where
        ``bincount`` has no kernel (its output size depends on the data)."""
        return torch.bincount(indices.reshape(-1), minlength=self.num_experts).to(torch.float32)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """``expert_bias += rate * sign(mean(load) - load)`` for ``load`` [E], the (token, slot)
        pairs each expert got over the whole step; then start counting the next step."""
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.step_load.zero_()

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
        indices = self.choose(scores)
        chosen = scores.gather(1, indices)
        # Renormalise only for k > 1: with k = 1 the weight would be exactly 1 and the router
        # would get no gradient from the LM loss (Switch keeps the raw probability).
        probs = chosen / chosen.sum(dim=-1, keepdim=True) if self.k > 1 and self.norm_topk else chosen
        if self.scaling_factor is not None:
            probs = probs * self.scaling_factor

        E, T = self.num_experts, tokens.shape[0]
        counts = self.count_experts(indices)
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            # A recomputed forward counts again: every load doubles alike, the sign of the
            # load error does not change.
            self.step_load += counts
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
            counts_before=every[:r, :E].sum(dim=0), num_tokens=n_tokens, scores=chosen.detach())


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


def drop_by_score(indices: torch.Tensor, scores: torch.Tensor, capacity: int,
                  stats_group: Group | None) -> torch.Tensor:
    """Mark (token, slot) pairs beyond an expert's capacity as dropped (expert id -1), keeping
    each expert's ``capacity`` highest-scoring pairs of the whole microbatch; equal scores keep
    the earlier pair (microbatch position, then slot). The ranks of ``stats_group`` together hold
    the microbatch; the ids and scores are all-gathered over it, so the same pairs are dropped
    under every layout.

    Args:
        indices: ``[T, k]`` chosen expert ids of this rank's tokens.
        scores: ``[T, k]`` their router scores (:attr:`Routing.scores`).
        capacity: slots per expert (see :func:`expert_capacity`).
        stats_group: see :meth:`TopKRouter.forward`; None when this rank holds the microbatch.

    Returns:
        ``[T, k]`` int64, the kept expert ids and -1 where dropped.
    """
    n, r = indices.numel(), 0
    all_idx, all_scores = indices.reshape(-1), scores.reshape(-1)
    if stats_group is not None and stats_group.size > 1:
        all_idx = stats_group.all_gather(indices.contiguous(), 0).reshape(-1)
        all_scores = stats_group.all_gather(scores.contiguous(), 0).reshape(-1)
        r = stats_group.rank
    # Order by (expert, score descending, position): two stable sorts, the last key first.
    by_score = torch.sort(all_scores, descending=True, stable=True).indices
    order = by_score[torch.sort(all_idx[by_score], stable=True).indices]
    counts = torch.bincount(all_idx, minlength=1)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(all_idx)
    rank_in_expert[order] = torch.arange(all_idx.numel(), device=all_idx.device) - starts[all_idx[order]]
    kept = torch.where(rank_in_expert < capacity, all_idx, torch.full_like(all_idx, -1))
    return kept[r * n:(r + 1) * n].view_as(indices)
