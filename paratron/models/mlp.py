"""The dense MLP of a transformer layer: GELU (GPT-2) or SwiGLU (Shazeer 2020, "GLU Variants
Improve Transformer"; Llama), split over tensor-parallel ranks as column -> activation -> row
(Shoeybi et al. 2019, section 3, figure 3a).

SwiGLU's two input projections are one fused column-parallel weight ``fc1 = [gate; up]`` with a
strided :class:`~paratron.parallel.params.ShardSpec` (stride 2, Megatron-LM's
``partition_stride``): each TP rank holds its slice of ``gate`` and the same slice of ``up``, so
the activation is local, and under sequence parallelism the input is all-gathered once for both.
Checkpoints written with separate ``gate``/``up`` weights still load
(:mod:`paratron.checkpoint.legacy`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig
from paratron.layers import ColumnParallelLinear, RowParallelLinear
from paratron.layers.init import normal_
from paratron.parallel.context import ParallelContext


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Shazeer 2020, equation 6 with Swish_1)."""
    return F.silu(gate) * up


class _SwiGLUFn(torch.autograd.Function):
    """SwiGLU over the fused ``fc1`` output ``[..., 2f] = [gate, up]`` in one Function.

    Forward ``silu(gate) * up``: two kernels, as the composite form. Backward, written straight
    into the two halves of one ``[..., 2f]`` grad: ``d_gate = silu_backward(dy * up, gate)``
    (the kernel autograd uses) and ``d_up = dy * silu(gate)``, ``silu(gate)`` recomputed. The
    composite form computes the same products with the same kernels, so the result is bitwise
    equal, but it keeps ``silu(gate)`` (``[..., f]``) for the backward and joins the two half
    grads with a ``cat`` (one more ``[..., 2f]`` pass); this keeps only ``fc1``'s output."""

    @staticmethod
    def forward(fctx, fc1_out):
        gate, up = fc1_out.chunk(2, dim=-1)
        fctx.save_for_backward(fc1_out)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(fctx, dy):
        (fc1_out,) = fctx.saved_tensors
        gate, up = fc1_out.chunk(2, dim=-1)
        grad = torch.empty_like(fc1_out, memory_format=torch.contiguous_format)
        d_gate, d_up = grad.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(torch.mul(dy, up), gate, grad_input=d_gate)
        torch.ops.aten.silu.out(gate, out=d_up)
        d_up.mul_(dy)
        return grad


def swiglu_fused(fc1_out: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu` of the two halves of ``fc1_out`` ``[..., 2f]`` -> ``[..., f]``.

    Eager: :class:`_SwiGLUFn` (same values and grads, less kept and one pass fewer); under
    ``torch.compile`` (``model.compile``) the composite form, which the compiler fuses itself."""
    if torch.compiler.is_compiling():
        return swiglu(*fc1_out.chunk(2, dim=-1))
    return _SwiGLUFn.apply(fc1_out)


def gelu(x: torch.Tensor, activation: str) -> torch.Tensor:
    """GELU, in GPT-2's tanh form for ``activation == "gelu_tanh"``."""
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def activate(activation: str, fc1_out: torch.Tensor) -> torch.Tensor:
    """The MLP's inner activation of ``fc1``'s output ``[..., f]`` (``[..., 2f]`` for SwiGLU: its
    two halves are this rank's gate and up slices) -> ``[..., f]``."""
    if activation == "swiglu":
        return swiglu_fused(fc1_out)
    return gelu(fc1_out, activation)


class MLP(nn.Module):
    """Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same layout.

    Args:
        cfg: ``hidden_size``, ``activation``, ``add_bias_linear``, ``init_method_std``.
        ctx: the parallel context.
        logical_name: the module's layout-free name, e.g. ``layers.3.mlp`` or
            ``layers.3.mlp.shared_expert``.
        ffn: the inner width ``f`` (:func:`paratron.config.model_shape.ffn_size` for the dense MLP).
        seed, sequence_parallel, params_dtype: as for the parallel linears.
        output_init: init of ``fc2`` (GPT-2's scaled init of residual-branch outputs).

    Parameters (under ``logical_name``): ``fc1.weight`` ``[f, h]`` (GELU) or ``[2f, h]`` =
    ``[gate; up]`` (SwiGLU), ``fc2.weight`` ``[h, f]``; biases when ``add_bias_linear``.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, logical_name: str, ffn: int, seed: int,
                 sequence_parallel: bool, params_dtype: torch.dtype, output_init=None):
        super().__init__()
        self.activation = cfg.activation
        fused = 2 if cfg.activation == "swiglu" else 1
        # The fused blocks draw their initial values as the separate gate/up weights did.
        blocks = (f"{logical_name}.gate", f"{logical_name}.up") if fused > 1 else None
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, fused * ffn, ctx, logical_name=f"{logical_name}.fc1",
                                        seed=seed, bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                                        init_method=normal_(cfg.init_method_std), params_dtype=params_dtype,
                                        stride=fused, block_names=blocks)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ctx, logical_name=f"{logical_name}.fc2", seed=seed,
                                     bias=cfg.add_bias_linear, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel, init_method=output_init,
                                     params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(activate(self.activation, self.fc1(x)))
