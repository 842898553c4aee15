"""Global gradient norm and clipping (Pascanu et al. 2013, section 3.2), over every parallel axis.

The global norm is ``sqrt(sum over logical grad elements of g^2)``. Each rank adds the squares
of the grad elements it *owns* (see :func:`owns_for_norm`) and one all-reduce over the world
sums them: so TP-sharded params add the sum of their shards, TP-replicated params count once
(TP rank 0), a tied embedding counts once (first pipeline stage), DP replicas count once (DP
rank 0 without ZeRO; with ZeRO-1 each rank owns a disjoint shard) and expert params count once
per expert (expert-DP rank 0, or its shard under ZeRO). Every rank gets the same sum, hence the
same clip coefficient.
"""

from __future__ import annotations

import math

import torch

from ..parallel.context import ParallelContext
from ..parallel.params import is_replica_owner, meta_of


def owns_for_norm(param, ctx: ParallelContext, *, dp_rank: int, sharded: bool) -> bool:
    """Whether this rank counts ``param``'s (owned) grad elements in the global norm.

    Args:
        param: a param marked by :func:`paratron.parallel.params.mark`.
        ctx: the parallel context.
        dp_rank: this rank's index in the param's DP group (``dp_cp`` or ``expert_dp``).
        sharded: ZeRO-1 is on (ranks own disjoint slices, so every DP rank counts its slice).
    """
    tp_rank = ctx.expert_tp.rank if meta_of(param).is_expert else ctx.tp.rank
    if not is_replica_owner(param, tp_rank, ctx.is_first_stage):
        return False
    return sharded or dp_rank == 0


def sum_of_squares(views: list[torch.Tensor]) -> torch.Tensor:
    """``sum(v^2)`` over ``views`` as an fp64 scalar (0 for an empty list)."""
    if not views:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(views)
    return torch.stack(norms).double().square().sum()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """``min(1, max_norm / (total_norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` uses;
    1.0 when clipping is off (``max_norm <= 0``) or the norm is not finite."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
