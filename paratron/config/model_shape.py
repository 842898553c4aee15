"""Derived model sizes and the checks a model config must pass for a tensor-parallel size.

The model config leaves some sizes open (``num_query_groups``, ``ffn_hidden_size``,
``max_position_embeddings``); the functions here resolve them the same way everywhere (model
construction, the FLOPs formula, Hugging Face conversion), so that no two modules disagree.
"""

from __future__ import annotations

from .errors import ConfigError
from .sections import ModelConfig

LLAMA_FFN_MULTIPLE_OF = 256
"""Llama rounds its SwiGLU width 8h/3 up to a multiple of this (Touvron et al. 2023, code release)."""


def head_dim(cfg: ModelConfig) -> int:
    """Width of one attention head: ``hidden_size / num_attention_heads``."""
    return cfg.hidden_size // cfg.num_attention_heads


def query_groups(cfg: ModelConfig) -> int:
    """KV groups: ``num_query_groups``, or ``num_attention_heads`` (multi-head) when unset."""
    return cfg.num_query_groups if cfg.num_query_groups is not None else cfg.num_attention_heads


def ffn_size(cfg: ModelConfig) -> int:
    """MLP inner width: ``ffn_hidden_size``, else 4h (GELU) or Llama's 8h/3 rounded up to 256 (SwiGLU)."""
    if cfg.ffn_hidden_size is not None:
        return cfg.ffn_hidden_size
    if cfg.activation == "swiglu":
        m = LLAMA_FFN_MULTIPLE_OF
        return m * ((int(8 * cfg.hidden_size / 3) + m - 1) // m)
    return 4 * cfg.hidden_size


def max_positions(cfg: ModelConfig) -> int:
    """Rows of the learned position table: ``max_position_embeddings`` or ``seq_length``."""
    return cfg.max_position_embeddings or cfg.seq_length


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether global layer ``layer`` (0-based) holds an MoE MLP: ``layer % moe_layer_freq == 0``."""
    return cfg.num_experts > 0 and layer % cfg.moe_layer_freq == 0


def check_model(cfg: ModelConfig, tp: int) -> None:
    """Check the model config against tensor-parallel size ``tp``, before any collective.

    Raises:
        ConfigError: naming the field, value and rule: a missing vocab size; hidden size not
            divisible by heads; heads or KV groups not divisible by ``tp``; heads not divisible by
            KV groups; odd RoPE head dim; MLP width not divisible by ``tp``.
    """
    if cfg.vocab_size is None or cfg.vocab_size < 1:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} must be set to a positive integer "
                          "before building the model (take it from the tokenizer)")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        v = getattr(cfg, name)
        if v < (0 if name == "num_layers" else 1):
            raise ConfigError(f"model.{name}={v} must be a positive integer")
    heads, groups = cfg.num_attention_heads, query_groups(cfg)
    if cfg.hidden_size % heads:
        raise ConfigError(f"model.hidden_size={cfg.hidden_size} is not divisible by "
                          f"model.num_attention_heads={heads}")
    if groups < 1 or heads % groups:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by "
                          f"model.num_query_groups={groups}")
    if heads % tp:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by parallel.tensor={tp}")
    if groups % tp:
        raise ConfigError(f"model.num_query_groups={groups} is not divisible by parallel.tensor={tp} "
                          "(each tensor-parallel rank holds whole KV groups)")
    if cfg.position_embedding_type == "rope" and head_dim(cfg) % 2:
        raise ConfigError(f"RoPE needs an even head dim; model.hidden_size/model.num_attention_heads "
                          f"= {head_dim(cfg)}")
    if ffn_size(cfg) % tp:
        raise ConfigError(f"model.ffn_hidden_size={ffn_size(cfg)} is not divisible by parallel.tensor={tp}")
    if cfg.position_embedding_type == "learned" and cfg.seq_length > max_positions(cfg):
        raise ConfigError(f"model.seq_length={cfg.seq_length} exceeds "
                          f"model.max_position_embeddings={max_positions(cfg)}")
