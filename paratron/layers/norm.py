"""LayerNorm and RMSNorm with replicated weights, computed in fp32.

Under sequence parallelism the norms run on the sequence shard ``[s/tp, b, h]`` (Korthikanti et
al. 2022, section 4.2.2), so each TP rank's weight grad is a partial sum over its positions: the
weights are marked ``sequence_parallel`` and
:func:`~paratron.parallel.grads.allreduce_sequence_parallel_grads` sums them over TP, which keeps
the replicas bitwise equal.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.context import ParallelContext
from ..parallel.params import mark

__all__ = ["LayerNorm", "RMSNorm"]


class LayerNorm(nn.Module):
    """Layer normalisation (Ba et al. 2016, section 3) over the last dim.

    Args:
        hidden: h.
        ctx: the parallel context (parameters go on ``ctx.device``).
        logical_name: params are ``<name>.weight`` (ones) and ``<name>.bias`` (zeros).
        eps: added to the variance.
        sequence_parallel: mark the params for the SP grad all-reduce.
        params_dtype: parameter dtype.
        bias: learn a bias.

    ``forward(x)``: ``[s, b, h]`` (or ``[s/tp, b, h]``), any float dtype; statistics in fp32;
    returns the same shape and dtype.
    """

    def __init__(self, hidden: int, ctx: ParallelContext, *, logical_name: str, eps: float = 1e-5,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 bias: bool = True):
        super().__init__()
        _init_norm(self, hidden, ctx, logical_name, eps, sequence_parallel, params_dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden, device=ctx.device, dtype=params_dtype))
            mark(self.bias, f"{logical_name}.bias", sequence_parallel=sequence_parallel, no_weight_decay=True)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.float()
        y = nn.functional.layer_norm(x.float(), (self.hidden,), self.weight.float(), b, self.eps)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (Zhang and Sennrich 2019, section 3):
    ``x / sqrt(mean(x^2) + eps) * weight``, over the last dim.

    Args: as :class:`LayerNorm`, without a bias.

    ``forward(x)``: ``[s, b, h]`` (or ``[s/tp, b, h]``); fp32 inside; same shape and dtype out.
    """

    def __init__(self, hidden: int, ctx: ParallelContext, *, logical_name: str, eps: float = 1e-5,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        _init_norm(self, hidden, ctx, logical_name, eps, sequence_parallel, params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and not torch.compiler.is_compiling():
            return _RMSNormFn.apply(x, self.weight, self.eps)
        # Other dtypes, and under torch.compile (which fuses the composite form itself).
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}"


class _RMSNormFn(torch.autograd.Function):
    """fp32 RMSNorm with a hand-written backward: ``y = x * r * w`` with ``r = rsqrt(mean(x^2) +
    eps)`` per row; ``dx = r * (g - x_hat * mean(g * x_hat))`` with ``g = dy * w`` and
    ``x_hat = x * r``, ``dw = sum over rows of dy * x_hat``. The same math as autograd through
    the composite form, in fewer passes over ``[tokens, h]``; keeps ``x`` and ``r``."""

    @staticmethod
    def forward(fctx, x, weight, eps: float):
        r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
        fctx.save_for_backward(x, r, weight)
        return torch.mul(x, r).mul_(weight)

    @staticmethod
    def backward(fctx, dy):
        x, r, weight = fctx.saved_tensors
        x_hat = torch.mul(x, r)
        dw = None
        if fctx.needs_input_grad[1]:
            dw = torch.mul(dy, x_hat).reshape(-1, x.shape[-1]).sum(dim=0)
        g = torch.mul(dy, weight)
        mean_gx = torch.linalg.vecdot(g, x_hat, dim=-1).unsqueeze(-1).div_(x.shape[-1])
        dx = g.addcmul_(x_hat, mean_gx, value=-1.0).mul_(r)
        return dx, dw, None


def _init_norm(norm: nn.Module, hidden: int, ctx: ParallelContext, logical_name: str, eps: float,
               sequence_parallel: bool,
               params_dtype: torch.dtype) -> None:
    """Shared set-up of both norms: checks, and a weight of ones marked replicated over TP (and
    sequence_parallel under SP, so its grads are summed over TP) with no weight decay."""
    if hidden < 1 or eps < 0:
        raise ValueError(f"{logical_name}: need hidden >= 1 and eps >= 0, got {hidden}, {eps}")
    norm.hidden, norm.eps, norm.logical_name = int(hidden), float(eps), logical_name
    norm.weight = nn.Parameter(torch.ones(hidden, device=ctx.device, dtype=params_dtype))
    mark(norm.weight, f"{logical_name}.weight", sequence_parallel=sequence_parallel, no_weight_decay=True)
