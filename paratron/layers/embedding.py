"""Vocab-parallel input embedding and output layer (Shoeybi et al. 2019, section 3: "we
parallelize the input embedding weight matrix along the vocabulary dimension").

The vocabulary is padded to a multiple of ``tp * make_vocab_size_divisible_by`` so that every TP
rank holds ``V_pad / tp`` rows. The full ``[vocab, h]`` table is drawn unpadded from
``(seed, <name>.weight)``; padding rows are zero, excluded from the :class:`ShardSpec` (so
checkpoints and conversions see only the logical table), never looked up, and their logits are
excluded from the loss by :func:`~paratron.layers.cross_entropy.vocab_parallel_cross_entropy`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.context import ParallelContext
from ..parallel.mappings import (check_sequence_divisible, copy_to_tp_region,
                                 gather_from_sequence_parallel_region, reduce_from_tp_region,
                                 reduce_scatter_to_sequence_parallel_region)
from ..parallel.params import ShardSpec, mark
from .init import InitMethod, init_shard_
from .linear import _ColumnFn

__all__ = ["pad_vocab_size", "vocab_range", "VocabParallelEmbedding", "ParallelLMHead",
           "vocab_parallel_logits"]


def pad_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """The smallest multiple of ``tp * make_vocab_size_divisible_by`` that is >= ``vocab_size``.

    Raises:
        ValueError: a non-positive argument (naming it).
    """
    for name, v in (("model.vocab_size", vocab_size), ("parallel.tensor", tp),
                    ("model.make_vocab_size_divisible_by", make_vocab_size_divisible_by)):
        if int(v) < 1:
            raise ValueError(f"{name}={v} must be >= 1")
    m = tp * make_vocab_size_divisible_by
    return -(-vocab_size // m) * m


def vocab_range(padded_vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of the padded vocab rows held by ``tp_rank``."""
    per = padded_vocab_size // tp
    return tp_rank * per, (tp_rank + 1) * per


def _make_vocab_weight(module: nn.Module, vocab_size, hidden_size, ctx: ParallelContext, logical_name, seed,
                       make_vocab_size_divisible_by, init_method, params_dtype) -> None:
    """Create ``module.weight`` ``[V_pad/tp, h]`` holding this rank's rows (zero padding)."""
    tp, r = ctx.tp.size, ctx.tp.rank
    module.vocab_size, module.hidden_size = int(vocab_size), int(hidden_size)
    module.padded_vocab_size = pad_vocab_size(module.vocab_size, tp, make_vocab_size_divisible_by)
    module.vocab_start, module.vocab_end = vocab_range(module.padded_vocab_size, tp, r)
    per = module.vocab_end - module.vocab_start
    n_valid = max(0, min(module.vocab_size - module.vocab_start, per))
    spec = ShardSpec((module.vocab_size, module.hidden_size),
                     (min(module.vocab_start, module.vocab_size), 0), (n_valid, module.hidden_size))
    local = torch.zeros(per, module.hidden_size, device=ctx.device, dtype=params_dtype)  # padding rows stay 0
    module.weight = nn.Parameter(init_shard_(local, init_method, spec, seed, f"{logical_name}.weight"))
    mark(module.weight, f"{logical_name}.weight", spec, partition_dim=0)


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the table split along the (padded) vocabulary over TP.

    Each rank looks up the ids in its row range, writes zeros for the others, and the partial
    embeddings are summed over TP (all-reduce), or reduce-scattered along the sequence with
    sequence parallelism (Korthikanti et al. 2022, section 4.2.2).

    Args:
        vocab_size: logical vocabulary size (unpadded).
        hidden_size: h.
        ctx: the parallel context.
        logical_name: e.g. ``embedding.word``; the param is ``<name>.weight``.
        seed: the run's seed.
        make_vocab_size_divisible_by: see :func:`pad_vocab_size`.
        sequence_parallel: return ``[s/tp, b, h]``.
        init_method: see :mod:`paratron.layers.init`.
        params_dtype: parameter dtype.

    Attributes: ``vocab_size``, ``padded_vocab_size``, ``vocab_start``/``vocab_end`` (this rank's
    padded row range), ``weight`` ``[V_pad/tp, h]``.

    ``forward(ids)``: ``ids`` ``[b, s]`` int64 in ``[0, vocab_size)``; returns ``[s, b, h]``
    (identical on every TP rank), or ``[s/tp, b, h]`` with SP.

    Raises:
        ValueError: ids out of range; with SP, ``s`` not divisible by ``parallel.tensor``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, *, logical_name: str, seed: int,
                 make_vocab_size_divisible_by: int = 128, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group, self.logical_name, self.sequence_parallel = ctx.tp, logical_name, sequence_parallel
        _make_vocab_weight(self, vocab_size, hidden_size, ctx, logical_name, seed,
                           make_vocab_size_divisible_by, init_method, params_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2:
            raise ValueError(f"{self.logical_name}: token ids must be [b, s], got shape {tuple(ids.shape)}")
        if self.sequence_parallel:
            check_sequence_divisible(ids.shape[1], self.group)
        if ids.numel() and ids.device.type != "cpu":
            # A host check would stall the step on the device: an asynchronous device assert.
            torch._assert_async(((ids >= 0) & (ids < self.vocab_size)).all(),
                                f"{self.logical_name}: token ids must lie in [0, model.vocab_size={self.vocab_size})")
        elif ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"{self.logical_name}: token ids must lie in [0, model.vocab_size="
                             f"{self.vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]")
        ids = ids.t()  # [s, b]: the model's activation layout
        # Under DDP the lookup's grad is sparse (the looked-up rows only): DDP adds those rows into
        # the main grad, where a dense grad would zero-fill and add the whole [V_pad/tp, h] table
        # every microbatch. Without DDP the grad stays a dense .grad, as plain PyTorch expects, and
        # so it does on the dry run's meta device, which has no sparse kernels.
        sparse = self.weight.meta.grad_ready_hook is not None and self.weight.device.type != "meta"
        if self.group.size == 1:
            return nn.functional.embedding(ids, self.weight, sparse=sparse)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        emb = nn.functional.embedding(local_ids, self.weight, sparse=sparse).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(emb, self.group)
        return reduce_from_tp_region(emb, self.group)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), h={self.hidden_size}, "
                f"rows [{self.vocab_start}, {self.vocab_end}), sp={self.sequence_parallel}")


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, ctx: ParallelContext,
                          sequence_parallel: bool = False, *, owner: nn.Module | None = None
                          ) -> torch.Tensor:
    """Logits over this rank's slice of the padded vocabulary: ``X W^T`` with ``W`` split along
    the vocab (a column-parallel product, Shoeybi et al. 2019, section 3).

    The input enters the TP region by copy-to-region (all-reduce of its grad), or by the
    sequence all-gather under SP (reduce-scatter of its grad; Korthikanti et al. 2022, 4.2.2).

    Args:
        hidden: ``[s, b, h]`` (``[s/tp, b, h]`` with SP), replicated over TP.
        weight: ``[V_pad/tp, h]``: a tied :class:`VocabParallelEmbedding` weight or a
            :class:`ParallelLMHead` weight.
        ctx: the parallel context.
        sequence_parallel: whether ``hidden`` is sequence-sharded.
        owner: when given, the weight grad takes the :func:`accumulate_grad` path (and the
            owner's ``weight_grad_store``); otherwise it flows through autograd into ``.grad``
            (as a tied embedding's lookup grad does).
    Returns: logits ``[s, b, V_pad/tp]`` in the dtype of ``hidden``; columns at or past
        ``vocab_size`` are padding.
    """
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden width {hidden.shape[-1]} does not match the output weight "
                         f"width {weight.shape[-1]}")
    if owner is not None:
        return _ColumnFn.apply(hidden, weight, None, owner, ctx.tp, sequence_parallel)
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(hidden, ctx.tp)
    else:
        x = copy_to_tp_region(hidden, ctx.tp)
    return x.matmul(weight.t())


class ParallelLMHead(nn.Module):
    """Untied output layer with the same padded-vocab sharding as :class:`VocabParallelEmbedding`.

    Args: as :class:`VocabParallelEmbedding` (``hidden_size`` is the model width).

    ``forward(hidden)``: ``[s, b, h]`` (``[s/tp, b, h]`` with SP) -> logits ``[s, b, V_pad/tp]``.
    Its weight grad takes the :func:`~paratron.parallel.grads.accumulate_grad` path, deferred when
    ``weight_grad_store.deferring`` is True at backward time.
    """

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, *, logical_name: str, seed: int,
                 make_vocab_size_divisible_by: int = 128, sequence_parallel: bool = False,
                 init_method: InitMethod | None = None, params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.logical_name, self.sequence_parallel = logical_name, sequence_parallel
        self._ctx = ctx
        self.weight_grad_store = None
        _make_vocab_weight(self, vocab_size, hidden_size, ctx, logical_name, seed,
                           make_vocab_size_divisible_by, init_method, params_dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden, self.weight, self._ctx, self.sequence_parallel, owner=self)

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), h={self.hidden_size}, "
                f"sp={self.sequence_parallel}")
