"""Column- and row-parallel linear layers (Shoeybi et al. 2019, section 3), with sequence
parallelism (Korthikanti et al. 2022, section 4.2.2).

A column-parallel linear splits the weight ``[out, in]`` by rows (output features): each TP rank
computes ``out / tp`` features of the full input. A row-parallel linear splits it by columns
(input features): each rank multiplies its slice of the input and the partial outputs are summed
over TP. An MLP or attention block is ``column -> local op -> row`` with one collective forward
and one backward.

Weight grads do not travel back through autograd: the backward hands them to
:func:`paratron.parallel.grads.accumulate_grad` at once, or, when the module's
``weight_grad_store`` is a :class:`~paratron.parallel.grads.WeightGradStore` with
``deferring=True`` at backward time, queues a closure (the W action of zero-bubble schedules,
Qi et al. 2023, section 2). Biases inside the autograd function take the same path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.comm import Group
from ..parallel.context import ParallelContext
from ..parallel.grads import accumulate_grad, accumulate_matmul_grad, run_or_defer
from ..parallel.mappings import check_sequence_divisible, gather_from_tp_region, scatter_to_tp_region
from ..parallel.params import ShardSpec, mark
from .fp8 import fp8_matmul
from .init import InitMethod, init_shard_

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "divide", "local_linear"]


def divide(n: int, tp: int, field: str) -> int:
    """``n / tp``, or a ValueError naming ``field`` when it does not divide."""
    if n % tp:
        raise ValueError(f"{field}={n} is not divisible by parallel.tensor={tp}")
    return n // tp


def _mm(owner, a: torch.Tensor, b: torch.Tensor, kinds: str, sharded: tuple[bool, bool], k_split: bool):
    """``a [..., K] @ b [K, N]`` -> ``[..., N]``; in FP8 when ``owner.fp8`` holds a recipe (see
    :func:`paratron.layers.fp8.fp8_matmul` for ``kinds``/``sharded``/``k_split``)."""
    recipe = getattr(owner, "fp8", None)
    if recipe is None:
        return a.matmul(b)
    out = fp8_matmul(recipe, a.reshape(-1, a.shape[-1]), b, kinds, sharded, k_split, owner.group)
    return out.view(*a.shape[:-1], b.shape[-1])


def _weight_grads(owner, weight, bias, dy: torch.Tensor, x: torch.Tensor,
                  bias_dy: torch.Tensor | None = None, sharded: tuple[bool, bool] = (False, False)) -> None:
    """Compute ``dW = dy^T x`` and ``db = sum(bias_dy)`` (``bias_dy`` defaults to ``dy``) now,
    or queue them as one closure if the owner's weight-grad store is deferring. ``sharded``:
    whether ``dy`` and ``x`` are TP shards (for FP8 scales)."""
    want_w = weight.requires_grad
    want_b = bias is not None and bias.requires_grad
    if not (want_w or want_b):
        return
    bdy = dy if bias_dy is None else bias_dy

    def run() -> None:
        if want_w:
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            if getattr(owner, "fp8", None) is None:  # one GEMM accumulating into the main grad
                accumulate_matmul_grad(weight, dy2.t(), x2)
            else:
                accumulate_grad(weight, _mm(owner, dy2.t(), x2, "gx", sharded, False))
        if want_b:
            accumulate_grad(bias, bdy.reshape(-1, bdy.shape[-1]).sum(dim=0))

    run_or_defer(owner, run)


class _ColumnFn(torch.autograd.Function):
    """y = AllGather_seq?(x) W^T + b; backward: dx = AllReduce|ReduceScatter(dy W)."""

    @staticmethod
    def forward(fctx, x, weight, bias, owner, group: Group, sequence_parallel: bool):
        # With SP the gathered input is kept for dW rather than re-gathered in backward: one
        # all-gather per layer instead of two, at the cost of s*b*in activation memory.
        total = group.all_gather(x, dim=0) if sequence_parallel else x
        if getattr(owner, "fp8", None) is not None:
            out = _mm(owner, total, weight.t(), "xw", (False, True), False)
            out = out if bias is None else out + bias
        elif bias is not None:
            # One addmm instead of a matmul and a separate pass to add the bias.
            flat = total.reshape(-1, total.shape[-1])
            out = torch.addmm(bias, flat, weight.t()).view(*total.shape[:-1], weight.shape[0])
        else:
            out = total.matmul(weight.t())
        fctx.save_for_backward(total, weight)
        fctx.owner, fctx.group, fctx.sp, fctx.bias = owner, group, sequence_parallel, bias
        return out

    @staticmethod
    def backward(fctx, dy):
        total, weight = fctx.saved_tensors
        group, dx, work = fctx.group, None, None
        dy = dy.contiguous()
        if fctx.needs_input_grad[0]:
            dx_total = _mm(fctx.owner, dy, weight, "gw", (True, True), True)
            if group.size == 1:
                dx = dx_total
            elif fctx.sp:
                flat = dx_total.reshape(group.size, -1)
                dx = torch.empty((dx_total.shape[0] // group.size,) + tuple(dx_total.shape[1:]),
                                 dtype=dx_total.dtype, device=dx_total.device)
                work = group.reduce_scatter_into(dx.view(-1), flat.view(-1), async_op=True)
            else:
                dx = dx_total
                work = group.all_reduce(dx, async_op=True)
        # dW overlaps with the input-grad collective (Shoeybi et al. 2019 note the same overlap).
        _weight_grads(fctx.owner, weight, fctx.bias, dy, total, sharded=(True, False))
        if work is not None:
            work.wait()
        return dx, None, None, None, None, None


class _RowFn(torch.autograd.Function):
    """y = AllReduce|ReduceScatter_seq(x W^T) + b; backward: dx = AllGather_seq?(dy) W."""

    @staticmethod
    def forward(fctx, x, weight, bias, owner, group: Group, sequence_parallel: bool):
        partial = _mm(owner, x, weight.t(), "xw", (True, True), True)
        if sequence_parallel:
            out = group.reduce_scatter(partial, dim=0)
        else:
            group.all_reduce(partial)  # in place: ``partial`` is our own fresh buffer
            out = partial
        if bias is not None:
            out = out + bias
        fctx.save_for_backward(x, weight)
        fctx.owner, fctx.group, fctx.sp, fctx.bias = owner, group, sequence_parallel, bias
        return out

    @staticmethod
    def backward(fctx, dy):
        x, weight = fctx.saved_tensors
        dy = dy.contiguous()
        dy_total = fctx.group.all_gather(dy, dim=0) if fctx.sp else dy
        dx = _mm(fctx.owner, dy_total, weight, "gw", (False, True), False) if fctx.needs_input_grad[0] else None
        # The bias grad uses the local dy: under SP it is a sequence-shard partial sum, which
        # allreduce_sequence_parallel_grads completes over TP (the bias is marked so).
        _weight_grads(fctx.owner, weight, fctx.bias, dy_total, x, bias_dy=dy, sharded=(False, True))
        return dx, None, None, None, None, None


class _LocalFn(torch.autograd.Function):
    """y = x W^T + b with no collective (each rank's own rows, e.g. one MoE expert)."""

    @staticmethod
    def forward(fctx, x, weight, bias, owner):
        fctx.save_for_backward(x, weight)
        fctx.owner, fctx.bias = owner, bias
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(fctx, dy):
        x, weight = fctx.saved_tensors
        dy = dy.contiguous()
        dx = dy.matmul(weight) if fctx.needs_input_grad[0] else None
        _weight_grads(fctx.owner, weight, fctx.bias, dy, x)
        return dx, None, None, None


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T + bias [out]`` -> ``[..., out]``, with no collective.

    The input grad flows through autograd; the weight and bias grads take the linears' path
    (:func:`~paratron.parallel.grads.accumulate_grad`, deferred to the W action while
    ``owner.weight_grad_store`` is deferring; see the module docstring)."""
    return _LocalFn.apply(x, weight, bias, owner)


def _check_in(x: torch.Tensor, n: int, name: str) -> None:
    if x.shape[-1] != n:
        raise ValueError(f"{name}: input last dim is {x.shape[-1]}, expected {n} features "
                         f"(activations are [s, b, h])")


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by rows (output features) over TP (Shoeybi et al. 2019,
    section 3, equation 3); with sequence parallelism the input is all-gathered along the
    sequence first (Korthikanti et al. 2022, section 4.2.2).

    Args:
        in_features, out_features: the full (logical) sizes; ``out_features`` must divide by TP.
        ctx: the :class:`~paratron.parallel.context.ParallelContext`.
        logical_name: layout-independent module name; params are ``<name>.weight``/``.bias``.
        seed: the run's seed; the full weight is drawn from ``(seed, <name>.weight)``.
        bias: add a bias (split like the output, initialised to zero).
        gather_output: all-gather the output along the last dim (returns ``[..., out]``).
        sequence_parallel: the input is ``[s/tp, b, in]`` and is all-gathered along dim 0.
        init_method: see :mod:`paratron.layers.init` (default N(0, 0.02^2)).
        params_dtype: dtype of the parameters.
        skip_bias_add: return ``(output, bias)`` without adding the bias (for fused consumers).
        stride: the output features are ``stride`` equal fused blocks (SwiGLU's ``[gate; up]``),
            each split over TP as if it were its own column-parallel linear, so a rank's output
            is its slice of block 0, then of block 1, ... (Megatron-LM's ``partition_stride``;
            the weight's :class:`ShardSpec` is strided). Under SP the fused blocks share one
            all-gather of the input.
        block_names: with ``stride > 1``, the logical names whose ``(seed, <name>.weight)`` draw
            each block's initial values (default: one draw of the whole weight).

    Shapes: weight ``[out/tp, in]``, bias ``[out/tp]``. ``forward(x)``: ``x`` is ``[s, b, in]``
    (``[s/tp, b, in]`` with SP); returns ``[s, b, out/tp]``, or ``[s, b, out]`` if
    ``gather_output`` (which needs ``stride == 1``).

    Attribute ``weight_grad_store`` (default None): see the module docstring.

    Raises:
        ValueError: ``out_features`` not divisible by ``parallel.tensor``; input of the wrong
            width.
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, logical_name: str, seed: int,
                 bias: bool = True, gather_output: bool = False, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 skip_bias_add: bool = False, stride: int = 1, block_names: tuple[str, ...] | None = None):
        super().__init__()
        tp, r = ctx.tp.size, ctx.tp.rank
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.out_per_rank = divide(self.out_features, tp, f"{logical_name}: out_features")
        if stride < 1 or self.out_features % stride:
            raise ValueError(f"{logical_name}: out_features={self.out_features} does not split into stride={stride} "
                             "equal fused blocks")
        block = self.out_features // stride
        n = divide(block, tp, f"{logical_name}: out_features of one fused block")
        if gather_output and stride > 1:
            raise ValueError(f"{logical_name}: gather_output would interleave the fused blocks; use stride=1")
        self.group, self.logical_name = ctx.tp, logical_name
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.weight_grad_store = None
        self.fp8 = None  # an Fp8Recipe: FP8 matmuls (paratron/layers/fp8.py, enable_fp8)
        spec = ShardSpec((self.out_features, self.in_features), (r * n, 0), (self.out_per_rank, self.in_features),
                         stride)
        weight = torch.empty(self.out_per_rank, self.in_features, device=ctx.device, dtype=params_dtype)
        names = tuple(f"{name}.weight" for name in block_names) if block_names is not None else None
        self.weight = nn.Parameter(init_shard_(weight, init_method, spec, seed, f"{logical_name}.weight", names))
        mark(self.weight, f"{logical_name}.weight", spec, partition_dim=0)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_per_rank, device=ctx.device, dtype=params_dtype))
            mark(self.bias, f"{logical_name}.bias",
                 ShardSpec((self.out_features,), (r * n,), (self.out_per_rank,), stride),
                 partition_dim=0, no_weight_decay=True)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        _check_in(x, self.in_features, self.logical_name)
        fused_bias = None if self.skip_bias_add else self.bias
        out = _ColumnFn.apply(x, self.weight, fused_bias, self, self.group, self.sequence_parallel)
        if self.gather_output:
            out = gather_from_tp_region(out, self.group)
        if self.skip_bias_add:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (per rank {self.out_per_rank}), "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by columns (input features) over TP; the partial
    products are all-reduced (Shoeybi et al. 2019, section 3), or reduce-scattered along the
    sequence with sequence parallelism (Korthikanti et al. 2022, section 4.2.2). The bias is
    added after the reduction, so it is replicated (and marked ``sequence_parallel`` under SP:
    its grad is then a partial sum that :func:`~paratron.parallel.grads.allreduce_sequence_parallel_grads`
    completes).

    Args:
        in_features, out_features: the full sizes; ``in_features`` must divide by TP.
        ctx, logical_name, seed, bias, init_method, params_dtype, skip_bias_add: as in
            :class:`ColumnParallelLinear`.
        input_is_parallel: the input is already split along its last dim (``[s, b, in/tp]``);
            if False the full ``[s, b, in]`` input is split here.
        sequence_parallel: reduce-scatter the output along dim 0 (returns ``[s/tp, b, out]``).

    Shapes: weight ``[out, in/tp]``, bias ``[out]``. ``forward(x)``: returns ``[s, b, out]``
    (identical on every TP rank) or ``[s/tp, b, out]`` with SP.

    Raises:
        ValueError: ``in_features`` not divisible by ``parallel.tensor``; with SP, a sequence
            length not divisible by ``parallel.tensor`` (before any collective).
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, logical_name: str, seed: int,
                 bias: bool = True, input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32,
                 skip_bias_add: bool = False):
        super().__init__()
        tp, r = ctx.tp.size, ctx.tp.rank
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.in_per_rank = divide(self.in_features, tp, f"{logical_name}: in_features")
        self.group, self.logical_name = ctx.tp, logical_name
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.weight_grad_store = None
        self.fp8 = None  # an Fp8Recipe: FP8 matmuls (paratron/layers/fp8.py, enable_fp8)
        lo = r * self.in_per_rank
        spec = ShardSpec((self.out_features, self.in_features), (0, lo), (self.out_features, self.in_per_rank))
        weight = torch.empty(self.out_features, self.in_per_rank, device=ctx.device, dtype=params_dtype)
        self.weight = nn.Parameter(init_shard_(weight, init_method, spec, seed, f"{logical_name}.weight"))
        mark(self.weight, f"{logical_name}.weight", spec, partition_dim=1)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, device=ctx.device, dtype=params_dtype))
            mark(self.bias, f"{logical_name}.bias", sequence_parallel=sequence_parallel,
                 no_weight_decay=True)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            _check_in(x, self.in_features, self.logical_name)
            x = scatter_to_tp_region(x, self.group)
        _check_in(x, self.in_per_rank, self.logical_name)
        if self.sequence_parallel:
            check_sequence_divisible(x.shape[0], self.group)
        fused_bias = None if self.skip_bias_add else self.bias
        out = _RowFn.apply(x, self.weight, fused_bias, self, self.group, self.sequence_parallel)
        if self.skip_bias_add:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (per rank {self.in_per_rank}), out={self.out_features}, "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}")
