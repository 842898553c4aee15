"""Grouped expert GEMMs: every local expert's rows through its own weight in one call.

Layout: ``x`` is ``[N, in]`` rows, expert-major (the first ``counts[0]`` rows belong to expert 0,
...); ``weight`` is ``[E, in, out]``; the result is ``[N, out]`` in the same row order. An
expert with zero rows is allowed and gets a zero weight grad.

Three ways to compute it, one result (to fp32 rounding):

* ``grouped_mm``: ``torch._grouped_mm`` (PyTorch's grouped GEMM, CPU and CUDA), one kernel over
  the ragged groups given by the cumulative row offsets. It needs 16-byte aligned row strides
  (``in`` and ``out`` times the element size divisible by 16) and fp32/bf16; its backward is
  written here (two more grouped GEMMs) because the autograd formula rejects the broadcast
  (stride-0) grads a ``.sum()`` produces.
* ``bmm``: rows scattered into a zero-padded ``[E, max_rows, in]`` block, one ``torch.bmm``.
  Wastes ``E * max_rows - N`` rows of compute, so it is chosen only when that is small.
* ``loop``: one GEMM per expert (the reference, and the fallback for very uneven loads).

``method="auto"`` picks ``grouped_mm`` when it applies, else ``bmm`` when the padding at most
doubles the rows (:data:`BMM_MAX_PADDING`), else ``loop``.
"""

from __future__ import annotations

from typing import Callable

import torch

METHODS = ("auto", "grouped_mm", "bmm", "loop")
BMM_MAX_PADDING = 2.0
"""``bmm`` is chosen by ``auto`` while ``E * max_rows <= BMM_MAX_PADDING * N``."""


def grouped_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run ``x [N, in] @ weight [E, in, out]`` on this build."""
    # CUDA's kernel is bf16-only (Hopper); the CPU one also takes fp32.
    dtypes = (torch.bfloat16,) if x.is_cuda else (torch.float32, torch.bfloat16)
    if not hasattr(torch, "_grouped_mm") or x.dtype not in dtypes:
        return False
    size = x.element_size()
    return x.shape[0] > 0 and (weight.shape[1] * size) % 16 == 0 and (weight.shape[2] * size) % 16 == 0


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with a backward that makes the incoming grad contiguous first."""

    @staticmethod
    def forward(fctx, x, weight, offs):
        fctx.save_for_backward(x, weight, offs)
        return torch._grouped_mm(x, weight, offs=offs)

    @staticmethod
    def backward(fctx, grad):
        x, weight, offs = fctx.saved_tensors
        grad = grad.contiguous()
        gx = torch._grouped_mm(grad, weight.transpose(1, 2), offs=offs) if fctx.needs_input_grad[0] else None
        gw = _grouped_mm_weight_grad(x, grad, offs) if fctx.needs_input_grad[1] else None
        return gx, gw, None


def _grouped_mm_weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # [in, N] @ [N, out] split along N at the same offsets -> [E, in, out].
    return torch._grouped_mm(x.t(), dy, offs=offs)


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts, device=device), 0).to(torch.int32)


def _padded_positions(counts: list[int], device) -> tuple[torch.Tensor, int]:
    """Row ``i`` of expert ``e`` -> ``e * max_rows + (i - start_e)``; returns (positions, max_rows)."""
    c = torch.tensor(counts, dtype=torch.int64, device=device)
    m = max(counts)
    starts = torch.cumsum(c, 0) - c
    experts = torch.repeat_interleave(torch.arange(len(counts), device=device), c)
    within = torch.arange(int(c.sum()), device=device) - starts[experts]
    return experts * m + within, m


def _bmm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    pos, m = _padded_positions(counts, x.device)
    E, n_in, n_out = weight.shape
    padded = x.new_zeros(E * m, n_in).index_copy(0, pos, x).view(E, m, n_in)
    return torch.bmm(padded, weight).reshape(E * m, n_out).index_select(0, pos)


def _loop(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    # Empty slices still multiply, so idle experts get zero grads rather than None.
    return torch.cat([part @ weight[e] for e, part in enumerate(torch.split(x, counts))])


def choose_method(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> str:
    """The ``auto`` choice for these rows (see the module docstring)."""
    if grouped_mm_applies(x, weight):
        return "grouped_mm"
    n = sum(counts)
    if n > 0 and len(counts) * max(counts) <= BMM_MAX_PADDING * n:
        return "bmm"
    return "loop"


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], method: str = "auto",
                   weight_grad: Callable[[Callable[[], torch.Tensor]], None] | None = None) -> torch.Tensor:
    """``[N, in]`` expert-major rows times ``weight [E, in, out]`` per expert -> ``[N, out]``.

    With ``weight_grad`` the weight is a constant to autograd: the backward computes the input
    grad and calls ``weight_grad(compute)``, where ``compute()`` returns the ``[E, in, out]``
    weight grad (:func:`grouped_weight_grad`); the caller runs it at once or in a later W action.

    Raises:
        ValueError: ``counts`` has not ``E`` entries or does not sum to ``N``; unknown ``method``
            (one of :data:`METHODS`); ``grouped_mm`` asked for where it does not apply.
    """
    if len(counts) != weight.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_linear: counts={counts} do not match {weight.shape[0]} experts "
                         f"and {x.shape[0]} rows")
    if method not in METHODS:
        raise ValueError(f"grouped_linear: unknown method {method!r}; one of {METHODS}")
    if method == "auto":
        method = choose_method(x, weight, counts)
    if method == "grouped_mm":
        if not grouped_mm_applies(x, weight):
            raise ValueError(f"grouped_linear: torch._grouped_mm does not apply to {x.dtype} "
                             f"[{x.shape[0]}, {weight.shape[1]}] x [{weight.shape[2]}] (needs fp32/bf16, "
                             "rows > 0 and 16-byte aligned sizes)")
    if weight_grad is not None:
        return _SplitWeightGrad.apply(x, weight.detach(), counts, method, weight_grad)
    return _dispatch(x, weight, counts, method)


def _dispatch(x: torch.Tensor, weight: torch.Tensor, counts: list[int], method: str) -> torch.Tensor:
    """The product by an already chosen and checked ``method`` (not ``auto``)."""
    if method == "grouped_mm":
        return _GroupedMM.apply(x.contiguous(), weight, _offsets(counts, x.device))
    if method == "bmm" and sum(counts) > 0:
        return _bmm(x, weight, counts)
    return _loop(x, weight, counts)


def grouped_weight_grad(x: torch.Tensor, dy: torch.Tensor, counts: list[int], method: str) -> torch.Tensor:
    """The weight grad of :func:`grouped_linear`: ``[E, in, out]``, expert ``e``'s
    ``x_e^T dy_e`` (``x [N, in]``, ``dy [N, out]`` expert-major), zeros for an expert with no rows.
    ``method`` is the one the forward ran (not ``auto``); the same GEMMs autograd runs for it."""
    if method == "grouped_mm":
        return _grouped_mm_weight_grad(x.contiguous(), dy.contiguous(), _offsets(counts, x.device))
    if method == "bmm" and sum(counts) > 0:
        pos, m = _padded_positions(counts, x.device)
        E = len(counts)
        px = x.new_zeros(E * m, x.shape[1]).index_copy(0, pos, x).view(E, m, x.shape[1])
        pdy = dy.new_zeros(E * m, dy.shape[1]).index_copy(0, pos, dy).view(E, m, dy.shape[1])
        return torch.bmm(px.transpose(1, 2), pdy)
    return torch.stack([a.t() @ b for a, b in zip(torch.split(x, counts), torch.split(dy, counts))])


class _SplitWeightGrad(torch.autograd.Function):
    """:func:`grouped_linear` whose backward returns only the input grad and hands the weight
    grad, as a closure, to ``weight_grad`` (zero-bubble B/W split, Qi et al. 2023, section 2)."""

    @staticmethod
    def forward(fctx, x, weight, counts, method, weight_grad):
        fctx.save_for_backward(x, weight)
        fctx.counts, fctx.method, fctx.weight_grad = counts, method, weight_grad
        return _dispatch(x, weight, counts, method)

    @staticmethod
    def backward(fctx, dy):
        x, weight = fctx.saved_tensors
        counts, method, dy = fctx.counts, fctx.method, dy.contiguous()
        dx = _dispatch(dy, weight.transpose(1, 2), counts, method) if fctx.needs_input_grad[0] else None
        fctx.weight_grad(lambda: grouped_weight_grad(x, dy, counts, method))
        return dx, None, None, None, None


class RowBias(torch.autograd.Function):
    """``y [N, out] + bias[row_expert]`` (``bias [E, out]``, ``row_expert [N]``) when ``add``,
    else ``y`` unchanged; the bias grad is always the per-expert sum of the row grads. With
    ``add=False`` on all but one rank of the expert-TP group the partial outputs summed afterwards
    hold the bias once, and every rank still gets the full bias grad (the same output grads reach
    every rank). With ``bias_grad`` (as ``weight_grad`` of :func:`grouped_linear`) the bias is a
    constant to autograd and ``bias_grad(compute)`` receives a closure computing the ``[E, out]``
    grad."""

    @staticmethod
    def forward(fctx, y, bias, row_expert, add: bool, bias_grad=None):
        fctx.save_for_backward(row_expert)
        fctx.num_experts, fctx.bias_grad = bias.shape[0], bias_grad
        return y + bias.index_select(0, row_expert) if add else y.clone()

    @staticmethod
    def backward(fctx, grad):
        (row_expert,) = fctx.saved_tensors
        n = fctx.num_experts

        def compute() -> torch.Tensor:
            return grad.new_zeros(n, grad.shape[-1]).index_add_(0, row_expert, grad)

        if fctx.bias_grad is not None:
            fctx.bias_grad(compute)
            return grad, None, None, None, None
        return grad, compute(), None, None, None
