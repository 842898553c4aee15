"""The config's normalisation layer, one builder for every block that needs one (its own module so
that the attention, the layer spec and the GPT head all import it without importing each other)."""

from __future__ import annotations

import torch
from torch import nn

from paratron.config import ModelConfig
from paratron.layers import LayerNorm, RMSNorm
from paratron.parallel.context import ParallelContext


def make_norm(cfg: ModelConfig, ctx: ParallelContext, logical_name: str, sequence_parallel: bool,
              params_dtype: torch.dtype,
              width: int | None = None) -> nn.Module:
    """LayerNorm or RMSNorm over h (or ``width``), per ``model.normalization`` (weights named
    ``{logical_name}.weight``)."""
    cls = RMSNorm if cfg.normalization == "rmsnorm" else LayerNorm
    return cls(width or cfg.hidden_size, ctx, logical_name=logical_name, eps=cfg.norm_epsilon,
               sequence_parallel=sequence_parallel, params_dtype=params_dtype)
