"""Tensor- and sequence-parallel layers: column/row-parallel linears, vocab-parallel embedding,
output layer and cross-entropy, norms, and layout-independent initialisation. Each reduces to the
plain layer when ``ctx.tp.size == 1``."""

from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import (ParallelLMHead, VocabParallelEmbedding, pad_vocab_size, vocab_parallel_logits,
                        vocab_range)
from .init import full_init, normal_, scaled_normal_
from .linear import ColumnParallelLinear, RowParallelLinear
from .norm import LayerNorm, RMSNorm

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelLMHead",
           "vocab_parallel_logits", "vocab_parallel_cross_entropy", "pad_vocab_size", "vocab_range",
           "LayerNorm", "RMSNorm", "full_init", "normal_", "scaled_normal_"]
