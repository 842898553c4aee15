"""One pre-norm transformer layer (Radford et al. 2019, section 2.3; Llama keeps the same shape):

    x = x + dropout(attention(norm1(x)))
    x = x + dropout(mlp(norm2(x)))

The MLP is the dense :class:`~paratron.models.mlp.MLP`, or an MoE layer from
``paratron.models.moe.layer`` when ``model.num_experts > 0`` and the layer is an MoE layer.
"""

from __future__ import annotations

import torch
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers.dropout import dropout

from .attention import SelfAttention
from .mlp import MLP


def make_norm(cfg: ModelConfig, ctx, logical_name: str, sequence_parallel: bool, params_dtype: torch.dtype
              ) -> nn.Module:
    """LayerNorm or RMSNorm over h, per ``model.normalization`` (weights named ``{logical_name}.weight``)."""
    from paratron.layers import LayerNorm, RMSNorm

    cls = RMSNorm if cfg.normalization == "rmsnorm" else LayerNorm
    return cls(cfg.hidden_size, ctx, logical_name=logical_name, eps=cfg.norm_epsilon,
               sequence_parallel=sequence_parallel, params_dtype=params_dtype)


class TransformerLayer(nn.Module):
    """Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same layout.

    ``layer_number`` is the *global* 0-based layer index; it names the parameters
    (``layers.{layer_number}.*``), so names do not depend on the pipeline layout.
    """

    def __init__(self, cfg: ModelConfig, ctx, *, layer_number: int, seed: int, sequence_parallel: bool,
                 params_dtype: torch.dtype, rng_tracker=None):
        from paratron.layers.init import scaled_normal_

        super().__init__()
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel and ctx.tp.size > 1
        self.rng_tracker = rng_tracker
        prefix = f"layers.{layer_number}"
        # GPT-2's scaled init of the residual-branch outputs: std / sqrt(2 * num_layers).
        output_init = scaled_normal_(cfg.init_method_std, max(cfg.num_layers, 1))
        self.input_norm = make_norm(cfg, ctx, f"{prefix}.input_norm", sequence_parallel, params_dtype)
        self.attention = SelfAttention(cfg, ctx, layer_number=layer_number, seed=seed,
                                       sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                                       rng_tracker=rng_tracker, output_init=output_init)
        self.post_attention_norm = make_norm(cfg, ctx, f"{prefix}.post_attention_norm", sequence_parallel,
                                             params_dtype)
        if model_shape.is_moe_layer(cfg, layer_number):
            from paratron.models.moe.layer import MoELayer

            self.mlp = MoELayer(cfg, ctx, layer_number=layer_number, seed=seed,
                                sequence_parallel=sequence_parallel, params_dtype=params_dtype)
        else:
            self.mlp = MLP(cfg, ctx, layer_number=layer_number, seed=seed, sequence_parallel=sequence_parallel,
                           params_dtype=params_dtype, output_init=output_init)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism each TP rank holds other positions: draw other masks.
        return dropout(x, self.hidden_dropout, self.training, self.rng_tracker, self.sequence_parallel)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self._dropout(self.attention(self.input_norm(x), rope))
        return x + self._dropout(self.mlp(self.post_attention_norm(x)))
