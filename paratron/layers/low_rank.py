"""Low-rank projections ``y = B silu(A x)`` under tensor parallelism: CoLA's factorised linear
(Liu et al. 2025, "CoLA: Compute-Efficient Pre-Training of LLMs via Low-Rank Activation",
the method section) with BOOST's two TP plans (BOOST, MLSys'26: its tensor-parallel plan
for low-rank layers; docs/boost.md).

A projection of ``in -> out`` features at rank ``r`` has ``A [r, in]`` and ``B [out, r]``
(:class:`LowRankFactor`). The plans split them as follows (``t`` = TP size):

* ``naive`` (Megatron's pairing, as for an MLP): A column-parallel (``A [r/t, in]``), the silu on
  the local ``r/t`` slice, B row-parallel (``B [out, r/t]``). The input is replicated
  (``[s, b, in]``; ``[s/t, b, in]`` all-gathered under sequence parallelism) and every factorised
  layer all-reduces (or reduce-scatters) its full ``out``-wide output.
* ``bottleneck`` (BOOST): A row-parallel (``A [r, in/t]`` on the ``in``-sharded input), one
  all-reduce of the ``r``-wide partial sums, silu, B column-parallel (``B [out/t, r]``): the
  output stays sharded along ``out``. Only ``r`` values per token cross the wire, forward and
  backward (every rank's B reads the same bottleneck, so its grad is summed too).

Projections that read the same input (q, k, v; SwiGLU's gate and up) are grouped: their A's are
concatenated into one GEMM, and, under ``naive``, their outputs share one all-reduce.

:class:`OnlineRMSNorm` is RMSNorm over a hidden-sharded input (``[s, b, h/t]``): each rank sums
the squares of its slice and one all-reduce of one value per token completes the mean (BOOST
"online RMSNorm"); the weight is sharded like the input.

All grads come from autograd (``.grad``), as for :mod:`paratron.models.lora`'s adapters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paratron.parallel.mappings import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                        reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region)
from paratron.parallel.params import ShardSpec, mark

from .init import init_shard_, normal_

__all__ = ["LowRankFactor", "OnlineRMSNorm", "bottleneck_all_reduce", "bottleneck_a", "bottleneck_b",
           "naive_group"]


def bottleneck_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial products over TP, forward *and* backward.

    The sum is read by per-rank different consumers (each rank's B slice, each rank's slice of the
    normed stream), so its grad is the sum of theirs: ``f`` after ``g`` of
    :mod:`paratron.parallel.mappings` (one all-reduce each way).
    """
    return copy_to_tp_region(reduce_from_tp_region(x, group), group)


class LowRankFactor(nn.Module):
    """The two factors of one projection ``in -> out`` at rank ``r``, split by ``plan``.

    Args:
        ctx: the parallel context (``ctx.tp``).
        logical_name: the projection's name; params ``{logical_name}.A.weight`` ``[r, in]`` and
            ``{logical_name}.B.weight`` ``[out, r]`` (full shapes).
        plan: ``"naive"`` (A ``[r/t, in]`` rows, B ``[out, r/t]`` columns) or ``"bottleneck"``
            (A ``[r, in/t]`` columns, B ``[out/t, r]`` rows).
        seed: the run's seed; each full tensor is drawn from (seed, logical name), per tile, so
            every TP layout starts from the same factors.
        b_init: init of B (e.g. the scaled output init); A is N(0, 1/in), so ``A x`` is O(1).

    Raises:
        ValueError: a split dimension not divisible by the TP size.
    """

    def __init__(self, ctx, logical_name: str, in_features: int, out_features: int, rank: int, plan: str, *,
                 seed: int, params_dtype: torch.dtype, b_init=None) -> None:
        super().__init__()
        t, tr = ctx.tp.size, ctx.tp.rank
        self.logical_name, self.rank = logical_name, rank
        a_dim, b_dim = (0, 1) if plan == "naive" else (1, 0)
        a_spec = _split((rank, in_features), a_dim, t, tr, logical_name)
        b_spec = _split((out_features, rank), b_dim, t, tr, logical_name)
        self.A = self._param(ctx, a_spec, a_dim, f"{logical_name}.A.weight", normal_(1.0 / math.sqrt(in_features)),
                             seed, params_dtype)
        self.B = self._param(ctx, b_spec, b_dim, f"{logical_name}.B.weight", b_init, seed, params_dtype)

    @staticmethod
    def _param(ctx, spec, dim, name, init, seed, dtype) -> nn.Parameter:
        p = torch.empty(spec.local_shape, device=ctx.device, dtype=dtype)
        p = nn.Parameter(init_shard_(p, init, spec, seed, name))
        mark(p, name, spec, partition_dim=dim if ctx.tp.size > 1 else -1)
        return p


def _split(shape: tuple[int, ...], dim: int, t: int, tr: int, name: str) -> ShardSpec:
    """TP rank ``tr``'s contiguous ``1/t`` of ``shape`` along ``dim``."""
    if shape[dim] % t:
        raise ValueError(f"{name}: dim {dim} of {shape} is not divisible by the TP size {t}")
    n = shape[dim] // t
    offsets = tuple(tr * n if d == dim else 0 for d in range(len(shape)))
    local = tuple(n if d == dim else s for d, s in enumerate(shape))
    return ShardSpec(shape, offsets, local)


def naive_group(x: torch.Tensor, factors, group, *, sp_in: bool, sp_out: bool) -> list[torch.Tensor]:
    """``naive`` plan of projections that read one input: ``[B_i silu(A_i x)]_i``.

    Args:
        x: ``[s, b, in]`` replicated, or ``[s/t, b, in]`` with ``sp_in`` (all-gathered here).
        factors: :class:`LowRankFactor` s of plan ``naive`` (A ``[r/t, in]``, B ``[out_i, r/t]``).
        sp_out: reduce-scatter the outputs along the sequence (``[s/t, b, out_i]``) instead of
            all-reducing them (``[s, b, out_i]`` replicated).
    Returns: one tensor per factor. Collectives: the input's (all-gather / grad all-reduce) and one
    all-reduce (or reduce-scatter) of the concatenated ``sum(out_i)``-wide partial outputs.
    """
    x = gather_from_sequence_parallel_region(x, group) if sp_in else copy_to_tp_region(x, group)
    z = F.silu(x.matmul(torch.cat([f.A for f in factors]).t()))  # one GEMM for the group
    parts = z.split([f.A.shape[0] for f in factors], dim=-1)
    y = torch.cat([p.matmul(f.B.t()) for p, f in zip(parts, factors)], dim=-1)  # partial sums over r
    y = reduce_scatter_to_sequence_parallel_region(y, group) if sp_out else reduce_from_tp_region(y, group)
    return list(y.split([f.B.shape[0] for f in factors], dim=-1))


def bottleneck_a(x: torch.Tensor, factors) -> torch.Tensor:
    """Local half of the ``bottleneck`` A GEMM: ``x [s, b, in/t]`` times the grouped A's
    ``[sum r_i, in/t]`` -> partial ``[s, b, sum r_i]`` (summed by :func:`bottleneck_all_reduce`)."""
    return x.matmul(torch.cat([f.A for f in factors]).t())


def bottleneck_b(z: torch.Tensor, factors) -> list[torch.Tensor]:
    """``bottleneck`` B side: ``silu`` of the summed ``[s, b, sum r_i]`` bottleneck, each part times
    its B slice ``[out_i/t, r]`` -> ``[s, b, out_i/t]`` per factor (no collective)."""
    parts = F.silu(z).split([f.rank for f in factors], dim=-1)
    return [p.matmul(f.B.t()) for p, f in zip(parts, factors)]


class OnlineRMSNorm(nn.Module):
    """RMSNorm of a hidden-sharded input (BOOST's online RMSNorm): ``x / rms(x) * w`` with
    ``rms(x)^2 = (sum over all t shards of x^2) / h + eps``.

    Forward: ``[s, b, h/t]`` -> ``[s, b, h/t]`` (fp32 inside, as :class:`paratron.layers.norm.RMSNorm`);
    one all-reduce of ``[s, b, 1]`` forward and one backward. Weight ``{logical_name}.weight``
    ``[h]`` split like the input (no weight decay). :meth:`sum_of_squares` and :meth:`apply` are
    the two halves, so a caller can put the collective between recomputed pieces.
    """

    def __init__(self, ctx, logical_name: str, hidden: int, eps: float, params_dtype: torch.dtype) -> None:
        super().__init__()
        self.group, self.hidden, self.eps, self.logical_name = ctx.tp, int(hidden), float(eps), logical_name
        spec = _split((hidden,), 0, ctx.tp.size, ctx.tp.rank, logical_name)
        self.weight = nn.Parameter(torch.ones(spec.local_shape, device=ctx.device, dtype=params_dtype))
        mark(self.weight, f"{logical_name}.weight", spec, partition_dim=0 if ctx.tp.size > 1 else -1,
             no_weight_decay=True)

    @staticmethod
    def local_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
        """``[s, b, 1]`` fp32: this shard's part of the per-token sum of squares."""
        return x.float().pow(2).sum(dim=-1, keepdim=True)

    def sum_of_squares(self, x: torch.Tensor) -> torch.Tensor:
        """The full per-token sum of squares ``[s, b, 1]`` (one all-reduce each way)."""
        return bottleneck_all_reduce(self.local_sum_of_squares(x), self.group)

    def apply(self, x: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
        """Normalise the shard ``x`` with the full ``sum_sq`` from :meth:`sum_of_squares`."""
        y = x.float() * torch.rsqrt(sum_sq / self.hidden + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.sum_of_squares(x))
