"""Context parallelism and packed-document attention.

* :mod:`.layout`: the sequence splits (load-balanced for the ring, contiguous for all2all), the
  per-document pieces of work, and :class:`SeqLayout`, which the model hands to every layer.
* :mod:`.kernels`: block attention with log-sum-exp, forward and backward, in fp32.
* :mod:`.ring`: ring attention (Liu et al. 2023), also used on one rank for packed documents.
* all2all (DeepSpeed-Ulysses, Jacobs et al. 2023, section 3): the head/sequence all-to-all
  exchange is :func:`paratron.parallel.mappings.all_to_all_seq_to_heads` and its inverse;
  :mod:`.ulysses` wraps exchange, attention and exchange back in one autograd function that
  keeps the attention output once.

:func:`context_attention` is the one entry point the attention module calls.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from paratron.parallel.comm import Group
from paratron.parallel.mappings import all_to_all_heads_to_seq, all_to_all_seq_to_heads

from .layout import (ALGORITHMS, SeqLayout, attention_flops_per_rank, chunk_ids, local_positions, sequence_layout,
                     shard_microbatch, shard_sequence)
from .ring import RingAttention
from .ulysses import UlyssesAttention

__all__ = ["ALGORITHMS", "SeqLayout", "context_attention", "attention_flops_per_rank", "chunk_ids",
           "local_positions", "sequence_layout", "shard_microbatch", "shard_sequence"]


# Where the fused block kernel runs (meta: the dry run, which counts the same saved tensors).
_ULYSSES_DEVICES = ("cpu", "meta")


def _local(layout: SeqLayout) -> SeqLayout:
    """The same microbatch seen whole by one rank (after the all2all gathered the sequence)."""
    one = Group(layout.cp.name, [0], 0, None, layout.cp.ledger)
    return SeqLayout(layout.seq_length, one, "ring", layout.cu_seqlens, layout.batch)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SeqLayout,
                      dense_core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                      ) -> torch.Tensor:
    """Causal (and per-document) attention of this rank's tokens over the whole sequence.

    Args:
        q: ``[s/C, b, n_q, d]``; ``k``, ``v``: ``[s/C, b, n_kv, d]``, this rank's tokens in
            ``layout`` order, RoPE already applied with global positions.
        layout: the microbatch's :class:`SeqLayout`.
        dense_core: plain causal attention ``(q, k, v) -> [s, b, n_q * d]`` over whole local
            sequences (used by all2all without packed documents on devices other than CPU,
            where :class:`UlyssesAttention`'s kernel would be the unfused math one).
    Returns:
        ``[s/C, b, n_q * d]`` in ``q``'s dtype.
    Raises:
        ValueError: all2all with head counts not divisible by the CP size.
    """
    s, b, n_q, d = q.shape
    scale = 1.0 / math.sqrt(d)
    if layout.algorithm == "ring" or layout.cp.size == 1:
        out = RingAttention.apply(q, k, v, layout if layout.cp.size > 1 else _local(layout), scale)
        return out.reshape(s, b, n_q * d)
    c = layout.cp.size
    if n_q % c or k.shape[2] % c:
        raise ValueError(f"all2all context parallelism splits the {n_q} query and {k.shape[2]} key/value "
                         f"heads of a TP rank over parallel.context={c}; they must divide")
    if layout.cu_seqlens is None and q.device.type in _ULYSSES_DEVICES:
        return UlyssesAttention.apply(q, k, v, layout.cp, scale).reshape(s, b, n_q * d)
    qh, kh, vh = (all_to_all_seq_to_heads(t, layout.cp) for t in (q, k, v))
    if layout.cu_seqlens is None:
        out = dense_core(qh, kh, vh).view(c * s, b, n_q // c, d)
    else:
        out = RingAttention.apply(qh, kh, vh, _local(layout), scale)
    return all_to_all_heads_to_seq(out, layout.cp).reshape(s, b, n_q * d)
