"""FP8 matmuls for the column- and row-parallel linears, with scales that do not depend on the
layout.

Each of a linear's three matmuls (forward ``y = x W^T``, input grad ``dx = dy W``, weight grad
``dW = dy^T x``) casts both operands to FP8 with a dynamic scale, ``scale = fp8_max / amax``,
and multiplies them with ``torch._scaled_mm`` (fp32 accumulation, output in the activations'
dtype). Activations and weights are ``float8_e4m3fn``; grads are ``float8_e5m2`` under the
"hybrid" format (more range, less precision: Micikevicius et al. 2022, "FP8 Formats for Deep
Learning", section 3) or e4m3 under "e4m3". Two scalings (as in torchao's float8 training and
TransformerEngine's current-scaling recipe):

* tensorwise: one scale per operand, from the amax of the whole *logical* tensor;
* rowwise: one scale per row of ``a [M, K]`` and per column of ``b [K, N]``, from the amax along
  the contraction dim ``K`` (so the scales factor out of the dot products exactly).

**Layout independence.** An amax taken on one rank's shard differs with the TP size, and so
would every quantised value. Here the amax is reduced (MAX, exact) over the TP group whenever
the reduced-over elements are split across it: for tensorwise, whenever the operand is a TP
shard (a column-parallel weight, a row-parallel input, a column-parallel output grad); for
rowwise, only when the contraction dim is split (the row-parallel forward, the column-parallel
input grad). Sequence-parallel inputs are cast after their all-gather, so they are whole, and
ZeRO-3 gathers params before the forward (its FP8 param gather reduces over DP and TP itself:
:mod:`paratron.optim.param_gather`). FP8 at TP=4 thus casts the same values as at TP=1; what
remains is fp32 summation order, as without FP8. Context parallelism splits each sequence, so
its activation amaxes would be per chunk; the config refuses FP8 with ``parallel.context > 1``.

Which layers: only :class:`~paratron.layers.linear.ColumnParallelLinear` and
:class:`~paratron.layers.linear.RowParallelLinear` (attention QKV/projection and MLA's
projections, MLP fc1/fc2, a MoE layer's shared expert).
The embedding, the output head and the MoE router do not go through them and stay in the run's
precision; norms stay fp32. Routed MoE expert linears stay high precision too: their token groups
change with the expert-parallel size, so a tensorwise activation amax (and any amax along the
token dim of the weight-grad matmul) would change with the layout.

Why not torchao's ``convert_to_float8_training`` (checked against torchao's
``float8_utils.tensor_to_amax``): it swaps ``nn.Linear`` modules for its ``Float8Linear``, and its
amax is ``max(|x|)`` of the tensor it is handed, reduced over a group only when a caller passes
``reduce_amax`` with a device mesh (its DTensor/FSDP2 paths, as torchtitan uses them).
paratron's linears are not ``nn.Linear`` and their shards are plain tensors (the autograd
functions hold the TP/SP collectives and hand weight grads to the main-grad buffers or the
zero-bubble W queue), so torchao would take shard-local amaxes, which is what breaks layout
independence; hooking the reduction into its internals is more code than the scaling here.

On CPU (torch 2.13) ``torch._scaled_mm`` accepts e4m3 and e5m2 operands with tensorwise scalar
and rowwise ``[M, 1]``/``[1, N]`` fp32 scales, so the same path runs here as on a GPU (where it
additionally needs dims divisible by 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Fp8Recipe", "enable_fp8", "fp8_matmul", "fp8_weights", "quantize", "recipe_of"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12  # an all-zero tensor gets a finite scale (its values cast to 0 under any scale)


@dataclass(frozen=True)
class Fp8Recipe:
    """``scaling``: "tensorwise" or "rowwise"; ``grad_dtype``: e5m2 (hybrid) or e4m3."""

    scaling: str = "tensorwise"
    grad_dtype: torch.dtype = E5M2

    def dtype(self, kind: str) -> torch.dtype:
        """The FP8 dtype of an operand of ``kind`` "x" (activation), "w" (weight) or "g" (grad)."""
        return self.grad_dtype if kind == "g" else E4M3


def recipe_of(train) -> Fp8Recipe | None:
    """The recipe of a :class:`~paratron.config.TrainConfig` (``fp8``, ``fp8_format``), or None
    when FP8 is off. ``fp8_format`` alone turns it on with tensorwise scaling."""
    if train.fp8 is None and train.fp8_format is None:
        return None
    fmt = train.fp8_format or "hybrid"
    return Fp8Recipe(train.fp8 or "tensorwise", E5M2 if fmt == "hybrid" else E4M3)


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``t`` to FP8 ``dtype`` with a dynamic scale.

    Args:
        t: a 2-D tensor.
        dim: None for one scale (tensorwise); else the dim reduced for the amax (rowwise: the
            contraction dim), kept as size 1.
        group: a :class:`~paratron.parallel.comm.Group` the amax is MAX-reduced over (the
            ranks that split the reduced-over elements), or None.

    Returns:
        ``(q, inv)``: ``q`` in ``dtype``, and the fp32 dequantisation scale ``amax / fp8_max``
        (a scalar, or ``t``'s shape with ``dim`` of size 1), so ``t ~= q * inv``.
    """
    tf = t.detach().float()
    amax = tf.abs().amax() if dim is None else tf.abs().amax(dim=dim, keepdim=True)
    if group is not None and group.size > 1:
        group.all_reduce(amax, op=dist.ReduceOp.MAX)
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp(min=_EPS)
    q = (tf * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def fp8_matmul(recipe: Fp8Recipe, a: torch.Tensor, b: torch.Tensor, kinds: str, sharded: tuple[bool, bool],
               k_split: bool, group) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` -> ``[M, N]`` in ``a``'s dtype, both operands cast to FP8.

    Args:
        kinds: two letters, the operands' kinds ("x", "w", "g"; see :meth:`Fp8Recipe.dtype`).
        sharded: whether each operand is this rank's shard of a tensor split over ``group``
            (tensorwise amaxes are then reduced over it).
        k_split: whether the contraction dim is split over ``group`` (rowwise amaxes are then
            reduced over it).
        group: the TP group.
    """
    rowwise = recipe.scaling == "rowwise"
    ga = group if (k_split if rowwise else sharded[0]) else None
    gb = group if (k_split if rowwise else sharded[1]) else None
    qa, sa = quantize(a, recipe.dtype(kinds[0]), 1 if rowwise else None, ga)
    qb, sb = quantize(b, recipe.dtype(kinds[1]), 0 if rowwise else None, gb)
    # _scaled_mm wants a row-major and b column-major: b^T made contiguous, seen transposed.
    qb = qb.t().contiguous().t()
    return torch._scaled_mm(qa.contiguous(), qb, scale_a=sa, scale_b=sb, out_dtype=a.dtype)


def enable_fp8(chunks, recipe: Fp8Recipe | None) -> int:
    """Turn FP8 on in every column/row-parallel linear of ``chunks`` (sets ``module.fp8``).
    Returns how many linears it set. The linears are found by the ``fp8`` slot they declare
    (``None`` when off), so this module need not import ``linear.py``, which imports it."""
    n = 0
    for chunk in chunks:
        for m in chunk.modules():
            if hasattr(m, "fp8"):
                m.fp8 = recipe
                n += 1
    return n


def fp8_weights(chunks) -> list[torch.nn.Parameter]:
    """The weights of the linears of ``chunks`` that run in FP8 (for the FP8 param gather)."""
    return [m.weight for chunk in chunks for m in chunk.modules() if getattr(m, "fp8", None) is not None]
