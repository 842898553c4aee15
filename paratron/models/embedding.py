"""Input embedding of the first pipeline stage: vocab-parallel word embeddings (Shoeybi et al. 2019,
section 3: the vocabulary split over tensor-parallel ranks), plus learned absolute positions
(GPT-2) when ``model.position_embedding_type == "learned"``, then hidden dropout.
"""

from __future__ import annotations

import torch
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers import VocabParallelEmbedding
from paratron.layers.dropout import dropout
from paratron.layers.init import init_shard_, normal_
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import ShardSpec, mark

WORD_EMBEDDINGS = "embedding.word_embeddings"
POSITION_EMBEDDINGS = "embedding.position_embeddings"


class Embedding(nn.Module):
    """Token ids ``[b, s]`` -> hidden ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).

    Parameters: ``embedding.word_embeddings.weight`` (full ``[V, h]``, held as
    ``[V_pad/tp, h]``) and, for learned positions, ``embedding.position_embeddings.weight``
    ``[max_position_embeddings, h]`` (replicated; under sequence parallelism each rank adds only
    its own positions, so that weight is marked ``sequence_parallel`` and its grads are summed
    over TP).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, seed: int, sequence_parallel: bool,
                 params_dtype: torch.dtype,
                 rng_tracker=None):
        super().__init__()
        self.tp = ctx.tp
        self.sequence_parallel = sequence_parallel and ctx.tp.size > 1
        self.hidden_dropout = cfg.hidden_dropout
        self.rng_tracker = rng_tracker
        self.word_embeddings = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, ctx, logical_name=WORD_EMBEDDINGS, seed=seed,
            make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
            sequence_parallel=sequence_parallel, init_method=normal_(cfg.init_method_std),
            params_dtype=params_dtype)
        if cfg.position_embedding_type == "learned":
            name = f"{POSITION_EMBEDDINGS}.weight"
            shape = (model_shape.max_positions(cfg), cfg.hidden_size)
            weight = torch.empty(shape, device=ctx.device, dtype=params_dtype)
            self.position_embeddings = nn.Parameter(init_shard_(
                weight, normal_(cfg.init_method_std), ShardSpec.replicated(shape), seed, name))
            mark(self.position_embeddings, name, sequence_parallel=self.sequence_parallel)
        else:
            self.register_parameter("position_embeddings", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``[b, s]`` int64 -> ``[s, b, h]`` or ``[s/tp, b, h]``.

        ``positions``: ``[s, b]`` or ``[s, 1]`` int64 positions of the tokens (global positions of a
        context-parallel rank's tokens, or positions restarting at each packed document); None
        means ``0 .. s - 1``.

        Raises:
            ValueError: a sequence longer than the position table (learned positions, no
                ``positions`` given).
        """
        x = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            s = input_ids.shape[1]
            # Given positions (packed documents, CP) index the table directly; the config rules
            # keep them below seq_length, while a packed row may be longer than the table.
            if positions is None and s > self.position_embeddings.shape[0]:
                raise ValueError(f"sequence length {s} exceeds model.max_position_embeddings="
                                 f"{self.position_embeddings.shape[0]}")
            lo, n = 0, s
            if self.sequence_parallel:
                n = s // self.tp.size
                lo = self.tp.rank * n
            if positions is None:
                x = x + self.position_embeddings[lo:lo + n].unsqueeze(1)
            else:
                x = x + self.position_embeddings[positions[lo:lo + n]]
        return dropout(x, self.hidden_dropout, self.training, self.rng_tracker, self.sequence_parallel)
