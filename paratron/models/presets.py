"""Ready model shapes: a GPT-2-style and a Llama-style model, plus tiny ones for tests and smoke runs.

``PRESETS`` maps a name to the model-config fields it sets (read-only); :func:`preset` builds a
fresh :class:`~paratron.config.ModelConfig` from them. The TOML files ``configs/gpt2-tiny.toml``
and ``configs/llama-tiny.toml`` carry the tiny ones as run configs.
"""

from __future__ import annotations

import difflib
from types import MappingProxyType

from paratron.config import ConfigError, ModelConfig

_GPT2 = dict(normalization="layernorm", position_embedding_type="learned", activation="gelu_tanh",
             add_bias_linear=True, tie_embeddings=True, norm_epsilon=1e-5)
_LLAMA = dict(normalization="rmsnorm", position_embedding_type="rope", activation="swiglu",
              add_bias_linear=False, tie_embeddings=False, norm_epsilon=1e-5, rope_theta=10000.0)

PRESETS = MappingProxyType({
    # GPT-2 small (Radford et al. 2019, table 2: 117M/124M): 12 layers, h=768, 12 heads, 1024 positions.
    "gpt2-small": MappingProxyType(dict(_GPT2, num_layers=12, hidden_size=768, num_attention_heads=12,
                                        vocab_size=50257, seq_length=1024, max_position_embeddings=1024,
                                        hidden_dropout=0.1, attention_dropout=0.1)),
    # A Llama-architecture model of GPT-2-small width (Touvron et al. 2023 shapes, scaled down):
    # GQA with 4 KV groups, SwiGLU width 2048 (= 8h/3 rounded up to 256), untied, no biases.
    "llama-small": MappingProxyType(dict(_LLAMA, num_layers=12, hidden_size=768, num_attention_heads=12,
                                         num_query_groups=4, ffn_hidden_size=2048, vocab_size=32000,
                                         seq_length=2048, max_position_embeddings=2048)),
    "gpt2-tiny": MappingProxyType(dict(_GPT2, num_layers=2, hidden_size=64, num_attention_heads=4,
                                       seq_length=64, max_position_embeddings=64)),
    "llama-tiny": MappingProxyType(dict(_LLAMA, num_layers=2, hidden_size=64, num_attention_heads=4,
                                        num_query_groups=2, ffn_hidden_size=176, seq_length=64)),
    # Mixtral's shape scaled down (Jiang et al. 2024): 8 SwiGLU experts, top-2, in every layer.
    "mixtral-tiny": MappingProxyType(dict(_LLAMA, num_layers=2, hidden_size=64, num_attention_heads=4,
                                          num_query_groups=2, ffn_hidden_size=176, seq_length=64,
                                          num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128,
                                          moe_aux_loss_coeff=0.02, moe_z_loss_coeff=0.001)),
})
"""Preset name -> model-config fields (read-only). Tiny presets leave ``vocab_size`` to the tokenizer."""


def preset(name: str, **overrides) -> ModelConfig:
    """A new :class:`ModelConfig` for preset ``name``, with ``overrides`` applied.

    Raises:
        ConfigError: an unknown preset name (with a did-you-mean).
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown model preset {name!r}{hint}; known: {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
