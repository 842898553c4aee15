"""One pre-norm transformer layer (Radford et al. 2019, section 2.3; Llama keeps the same shape):

    x = x + dropout(attention(norm1(x)))
    x = x + dropout(mlp(norm2(x)))

Its submodules come from a :class:`~paratron.models.layer_spec.TransformerLayerSpec`: by default
the config's norm, :class:`~paratron.models.attention.SelfAttention`, and the dense
:class:`~paratron.models.mlp.MLP` or, on MoE layers, :class:`~paratron.models.moe.layer.MoELayer`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers.dropout import dropout
from paratron.parallel.context import ParallelContext

from .layer_spec import LayerInputs, TransformerLayerSpec


class TransformerLayer(nn.Module):
    """Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same layout.

    ``layer_number`` is the *global* 0-based layer index; it names the parameters
    (``layers.{layer_number}.*``), so names do not depend on the pipeline layout. ``spec`` gives
    the submodules (default: :class:`TransformerLayerSpec` ``()``).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, layer_number: int, seed: int,
                 sequence_parallel: bool,
                 params_dtype: torch.dtype, rng_tracker=None, spec: TransformerLayerSpec | None = None):
        super().__init__()
        spec = spec or TransformerLayerSpec()
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel and ctx.tp.size > 1
        self.rng_tracker = rng_tracker
        inputs = LayerInputs(cfg, ctx, layer_number, seed, sequence_parallel, params_dtype, rng_tracker)
        self.input_norm = spec.input_norm(inputs, "input_norm")
        self.attention = spec.attention(inputs, "attention")
        self.post_attention_norm = spec.post_attention_norm(inputs, "post_attention_norm")
        mlp = spec.moe if model_shape.is_moe_layer(cfg, layer_number) else spec.mlp
        self.mlp = mlp(inputs, "mlp")

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism each TP rank holds other positions: draw other masks.
        return dropout(x, self.hidden_dropout, self.training, self.rng_tracker, self.sequence_parallel)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                layout=None) -> torch.Tensor:
        """``layout``: the microbatch's :class:`~paratron.models.context_parallel.SeqLayout` or None."""
        before_attention = getattr(self.mlp, "before_attention", None)
        if before_attention is not None:  # e.g. the MoE prefetch dispatcher's weight fetch
            before_attention()
        x = x + self._dropout(self.attention(self.input_norm(x), rope, layout))
        y = self.post_attention_norm(x)
        # The MoE layer needs the layout for its per-sequence aux loss (model.moe_aux_loss_type).
        y = self.mlp(y, layout) if getattr(self.mlp, "takes_layout", False) else self.mlp(y)
        return x + self._dropout(y)


def transformer_block(spec: TransformerLayerSpec) -> Callable[..., nn.Module]:
    """A block factory (for :func:`paratron.models.blocks.register_block`) that builds
    :class:`TransformerLayer` with ``spec``."""
    return functools.partial(TransformerLayer, spec=spec)
