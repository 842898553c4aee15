"""What a transformer layer is built from: one builder per submodule, swappable one at a time.

A :class:`TransformerLayerSpec` names a builder for each submodule of
:class:`~paratron.models.layer.TransformerLayer`: ``input_norm``, ``attention``,
``post_attention_norm``, and ``mlp`` (dense layers) or ``moe`` (MoE layers, see
:func:`paratron.config.model_shape.is_moe_layer`). A plugin replaces one of them and keeps the rest
(the idea of Megatron-Core's ``ModuleSpec`` / ``TransformerLayerSubmodules``)::

    spec = dataclasses.replace(TransformerLayerSpec(), attention=my_attention)
    register_block("my-attention", transformer_block(spec))   # then model.block = "my-attention"

A builder is called as ``builder(inputs, name)``: ``inputs`` is the :class:`LayerInputs` of the
layer, ``name`` the attribute the module is stored under (its parameters are named
``{inputs.prefix}.{name}.*``). It returns an ``nn.Module`` mapping ``[s, b, h]`` (``[s/tp, b, h]``
under sequence parallelism) to the same layout; an attention module's ``forward(x, rope, layout)``
also takes ``rope`` (the ``(cos, sin)`` tables or None) and ``layout`` (the context-parallel
:class:`~paratron.models.context_parallel.SeqLayout` or None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers.init import scaled_normal_
from paratron.models.moe.layer import MoELayer

from .low_rank import low_rank_attention, low_rank_mlp, uses_online_norm
from .norms import make_norm
from .attention import SelfAttention
from .mla import latent_attention
from .mlp import MLP


@dataclass(frozen=True)
class LayerInputs:
    """The arguments every submodule of global layer ``layer_number`` (0-based) is built from."""

    cfg: ModelConfig
    ctx: object
    layer_number: int
    seed: int
    sequence_parallel: bool
    params_dtype: torch.dtype
    rng_tracker: object = None

    @property
    def prefix(self) -> str:
        """``layers.{layer_number}``: the layout-free name of the layer."""
        return f"layers.{self.layer_number}"

    def output_init(self):
        """GPT-2's scaled init of the residual-branch outputs: std / sqrt(2 * num_layers)."""
        return scaled_normal_(self.cfg.init_method_std, max(self.cfg.num_layers, 1))


SubmoduleBuilder = Callable[[LayerInputs, str], nn.Module]


def norm(inputs: LayerInputs, name: str) -> nn.Module:
    """The config's norm (``model.normalization``); an identity under ``model.low_rank_tp =
    "bottleneck"``, whose online norms are part of the low-rank modules (docs/boost.md)."""
    if uses_online_norm(inputs.cfg):
        return nn.Identity()
    return make_norm(inputs.cfg, inputs.ctx, f"{inputs.prefix}.{name}", inputs.sequence_parallel,
                     inputs.params_dtype)


def self_attention(inputs: LayerInputs, name: str) -> nn.Module:
    """:class:`~paratron.models.attention.SelfAttention`, or under ``model.multi_latent_attention``
    :class:`~paratron.models.mla.LatentAttention` (its parameters are named ``{prefix}.attention.*``
    whatever ``name`` is)."""
    if inputs.cfg.low_rank:  # CoLA / BOOST (paratron/models/low_rank.py)
        return low_rank_attention(inputs, name)
    if inputs.cfg.multi_latent_attention:
        return latent_attention(inputs, name)

    return SelfAttention(inputs.cfg, inputs.ctx, layer_number=inputs.layer_number, seed=inputs.seed,
                         sequence_parallel=inputs.sequence_parallel, params_dtype=inputs.params_dtype,
                         rng_tracker=inputs.rng_tracker, output_init=inputs.output_init())


def dense_mlp(inputs: LayerInputs, name: str) -> nn.Module:
    """:class:`~paratron.models.mlp.MLP` of width :func:`~paratron.config.model_shape.ffn_size`."""
    if inputs.cfg.low_rank:  # CoLA / BOOST (paratron/models/low_rank.py)
        return low_rank_mlp(inputs, name)
    return MLP(inputs.cfg, inputs.ctx, logical_name=f"{inputs.prefix}.{name}", ffn=model_shape.ffn_size(inputs.cfg),
               seed=inputs.seed, sequence_parallel=inputs.sequence_parallel, params_dtype=inputs.params_dtype,
               output_init=inputs.output_init())


def moe_mlp(inputs: LayerInputs, name: str) -> nn.Module:
    """:class:`~paratron.models.moe.layer.MoELayer` (parameters named ``{prefix}.mlp.*``)."""
    return MoELayer(inputs.cfg, inputs.ctx, layer_number=inputs.layer_number, seed=inputs.seed,
                    sequence_parallel=inputs.sequence_parallel, params_dtype=inputs.params_dtype)


@dataclass(frozen=True)
class TransformerLayerSpec:
    """One builder per submodule of a transformer layer (see the module docstring)."""

    input_norm: SubmoduleBuilder = norm
    attention: SubmoduleBuilder = self_attention
    post_attention_norm: SubmoduleBuilder = norm
    mlp: SubmoduleBuilder = dense_mlp
    moe: SubmoduleBuilder = moe_mlp
