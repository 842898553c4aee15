"""The dense MLP of a transformer layer: GELU (GPT-2) or SwiGLU (Shazeer 2020, "GLU Variants
Improve Transformer"; Llama), split over tensor-parallel ranks as column -> activation -> row
(Shoeybi et al. 2019, section 3, figure 3a).

SwiGLU keeps its two input projections as separate column-parallel linears (``mlp.gate`` and
``mlp.up``): a fused ``[gate; up]`` weight would not split into one contiguous slice per rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig, model_shape


class MLP(nn.Module):
    """Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same layout.

    Parameters (under ``layers.{i}.mlp``): GELU: ``fc1.weight`` ``[f, h]``, ``fc2.weight`` ``[h, f]``;
    SwiGLU: ``gate.weight``, ``up.weight`` ``[f, h]``, ``fc2.weight`` ``[h, f]``; biases when
    ``add_bias_linear``. ``f`` is :func:`paratron.models.model_shape.ffn_size`.
    """

    def __init__(self, cfg: ModelConfig, ctx, *, layer_number: int, seed: int, sequence_parallel: bool,
                 params_dtype: torch.dtype, output_init=None):
        from paratron.layers import ColumnParallelLinear, RowParallelLinear
        from paratron.layers.init import normal_

        super().__init__()
        ffn = model_shape.ffn_size(cfg)
        prefix = f"layers.{layer_number}.mlp"
        self.activation = cfg.activation

        def column(name: str) -> nn.Module:
            return ColumnParallelLinear(cfg.hidden_size, ffn, ctx, logical_name=f"{prefix}.{name}", seed=seed,
                                        bias=cfg.add_bias_linear, sequence_parallel=sequence_parallel,
                                        init_method=normal_(cfg.init_method_std), params_dtype=params_dtype)

        if cfg.activation == "swiglu":
            self.gate, self.up = column("gate"), column("up")
        else:
            self.fc1 = column("fc1")
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, ctx, logical_name=f"{prefix}.fc2", seed=seed,
                                     bias=cfg.add_bias_linear, input_is_parallel=True,
                                     sequence_parallel=sequence_parallel, init_method=output_init,
                                     params_dtype=params_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(inner_activation(self, x))


def inner_activation(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP's inner activation, shared by the dense MLP and the experts: SwiGLU
    ``silu(gate(x)) * up(x)`` (Shazeer 2020) or GELU ``gelu(fc1(x))`` (tanh form for GPT-2), from the
    module's ``activation`` and its ``gate``/``up`` or ``fc1`` projections."""
    if mlp.activation == "swiglu":
        return F.silu(mlp.gate(x)) * mlp.up(x)
    approximate = "tanh" if mlp.activation == "gelu_tanh" else "none"
    return F.gelu(mlp.fc1(x), approximate=approximate)
