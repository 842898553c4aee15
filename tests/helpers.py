"""Helpers shared by the test files (imported as ``from helpers import ...``; pytest puts
``tests/`` on the path, as for the ``from test_x import ...`` imports)."""

from __future__ import annotations

import torch

from paratron.config import Config, ModelConfig


def gpt2_config(**sizes) -> ModelConfig:
    """A GPT-2-style model (LayerNorm, learned positions, GELU, biases, tied embeddings) of the
    given sizes (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``vocab_size``,
    ``seq_length``, and any other ``ModelConfig`` field to override)."""
    style = dict(normalization="layernorm", position_embedding_type="learned", activation="gelu",
                 add_bias_linear=True, tie_embeddings=True)
    return ModelConfig(**{**style, **sizes})


def config_with(**fields) -> Config:
    """The default :class:`Config` with ``section__key=value`` fields set (``model__num_experts=4``)."""
    cfg = Config()
    for key, value in fields.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def perturb_1d_params_(chunks, seed: int = 11) -> None:
    """Norm weights start at 1 and biases at 0 on every layout: add ``0.1 * N(0, 1)`` to every 1-D
    parameter, drawn from its full tensor by logical name (so every layout gets the same values),
    so that their grads and the bias paths are exercised."""
    for chunk in chunks:
        for p in chunk.parameters():
            if p.dim() == 1:
                g = torch.Generator().manual_seed(seed + sum(map(ord, p.logical_name)))
                full = 0.1 * torch.randn(p.shard.global_shape, generator=g)
                with torch.no_grad():
                    p.add_(full[p.shard.slices()].to(p.dtype))
