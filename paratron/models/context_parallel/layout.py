"""Where a rank's tokens sit in the full sequence under context parallelism, and how packed
documents cut it.

Splits (``parallel.context = C``):

``ring`` (load-balanced for causal attention; Megatron-LM's CP split)
    the sequence is cut into ``2C`` chunks of ``s / 2C`` tokens and CP rank ``i`` holds chunks
    ``i`` and ``2C - 1 - i``, in that order. Under a causal mask chunk ``j`` attends to ``j + 1``
    chunks' worth of keys, so each rank gets ``(i + 1) + (2C - i) = 2C + 1`` chunk-pairs of work.
``all2all`` (DeepSpeed-Ulysses, Jacobs et al. 2023)
    ``C`` contiguous chunks of ``s / C`` tokens, rank ``i`` holds chunk ``i``: every rank gathers
    the whole sequence (for its share of heads) before attending, so no balancing is needed.

Packed documents are given per sample as ``cu_seqlens`` ``[b, D + 1]`` (int64): the sorted start
offsets of the documents in the *full* sequence, then ``s``; a padded row repeats ``s`` (empty
documents are skipped). Attention never builds an ``[s, s]`` mask: :func:`pair_pieces` cuts each
(query chunk, key chunk) pair into per-document rectangles (cu_seqlens style).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from paratron.parallel.context import ParallelContext

ALGORITHMS = ("ring", "all2all")


def chunk_ids(cp_rank: int, cp_size: int, algorithm: str) -> tuple[int, ...]:
    """The global chunk indices held by CP rank ``cp_rank``, in local order.

    Raises:
        ValueError: an unknown ``algorithm`` (field ``parallel.context_algorithm``).
    """
    if algorithm == "ring":
        return (cp_rank,) if cp_size == 1 else (cp_rank, 2 * cp_size - 1 - cp_rank)
    if algorithm == "all2all":
        return (cp_rank,)
    raise ValueError(f"parallel.context_algorithm={algorithm!r} must be one of {ALGORITHMS}")


def num_chunks(cp_size: int, algorithm: str) -> int:
    """Chunks the sequence is cut into: ``2C`` for the ring (1 when C = 1), ``C`` for all2all."""
    return 2 * cp_size if algorithm == "ring" and cp_size > 1 else cp_size


def local_positions(seq_length: int, cp_rank: int, cp_size: int, algorithm: str,
                    device=None) -> torch.Tensor:
    """Global positions ``[s / C]`` (int64) of a CP rank's tokens, in local order."""
    c = seq_length // num_chunks(cp_size, algorithm)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device)
                      for j in chunk_ids(cp_rank, cp_size, algorithm)])


def shard_sequence(t: torch.Tensor, cp_rank: int, cp_size: int, algorithm: str, dim: int = 1) -> torch.Tensor:
    """A CP rank's tokens of ``t`` (e.g. token ids ``[b, s]``) along ``dim``: ``[b, s / C]``."""
    if cp_size == 1:
        return t
    idx = local_positions(t.shape[dim], cp_rank, cp_size, algorithm, device=t.device)
    return t.index_select(dim, idx)


@dataclass(frozen=True)
class Piece:
    """One rectangle of attention work: query rows ``q`` of the local query chunk against key rows
    ``k`` of one key chunk (both slices in chunk-local rows), for samples ``b`` (a slice or an
    index), with a causal triangle when both are the same chunk."""

    b: slice | int
    q: slice
    k: slice
    causal: bool


def pair_pieces(q_start: int, k_start: int, size: int, cu_seqlens: torch.Tensor | None) -> Iterator[Piece]:
    """The work of query chunk ``[q_start, q_start + size)`` against key chunk
    ``[k_start, k_start + size)`` (global positions) under a causal, optionally per-document mask.

    A key chunk after the query chunk gives nothing; an earlier one is a full rectangle; the same
    chunk is a causal triangle. With ``cu_seqlens`` ``[b, D + 1]`` each rectangle is cut per
    sample and document (tokens attend only inside their document).
    """
    if k_start > q_start:
        return
    causal = k_start == q_start
    if cu_seqlens is None:
        yield Piece(slice(None), slice(0, size), slice(0, size), causal)
        return
    bounds = cu_seqlens.tolist()
    for bi, row in enumerate(bounds):
        for ds, de in zip(row[:-1], row[1:]):
            qs, qe = max(q_start, ds), min(q_start + size, de)
            ks, ke = max(k_start, ds), min(k_start + size, de)
            if qs < qe and ks < ke:
                yield Piece(bi, slice(qs - q_start, qe - q_start), slice(ks - k_start, ke - k_start), causal)


def piece_flops(p: Piece, batch: int, heads: int, head_dim: int) -> int:
    """Forward matmul FLOPs of a piece (QK^T and PV, 2 FLOPs a multiply-add): ``4 d`` per score,
    counting only the scores under the mask."""
    nq, nk = p.q.stop - p.q.start, p.k.stop - p.k.start
    scores = nq * (nq + 1) // 2 if p.causal else nq * nk
    rows = batch if isinstance(p.b, slice) else 1
    return 4 * head_dim * heads * rows * scores


def attention_flops_per_rank(seq_length: int, cp_size: int, split: str, *, batch: int = 1, heads: int = 1,
                             head_dim: int = 1, cu_seqlens: torch.Tensor | None = None) -> list[int]:
    """Causal attention FLOPs of each CP rank, counted block by block as the ring runs them.

    ``split`` is ``"ring"`` (load-balanced, :func:`chunk_ids`) or ``"naive"`` (contiguous: rank
    ``i`` holds the ``i``-th ``s / C`` tokens). Every rank's query chunks meet every rank's key
    chunks once, as in the ring.
    """
    algorithm = "ring" if split == "ring" else "all2all"
    c = seq_length // num_chunks(cp_size, algorithm)
    held = [chunk_ids(r, cp_size, algorithm) for r in range(cp_size)]
    out = []
    for r in range(cp_size):
        total = 0
        for src in range(cp_size):
            for qj in held[r]:
                for kj in held[src]:
                    total += sum(piece_flops(p, batch, heads, head_dim)
                                 for p in pair_pieces(qj * c, kj * c, c, cu_seqlens))
        out.append(total)
    return out


@dataclass
class SeqLayout:
    """How one microbatch's tokens are laid out on this rank, handed to every layer.

    Attributes:
        seq_length: full sequence length ``s``.
        cp: the context-parallel :class:`~paratron.parallel.comm.Group`.
        algorithm: ``"ring"`` or ``"all2all"`` (``parallel.context_algorithm``).
        cu_seqlens: ``[b, D + 1]`` document starts per sample in the full sequence, or None (one
            document per sample).
        batch: samples in the microbatch.
    """

    seq_length: int
    cp: object
    algorithm: str = "ring"
    cu_seqlens: torch.Tensor | None = None
    batch: int = 1

    @property
    def chunks(self) -> tuple[int, ...]:
        return chunk_ids(self.cp.rank, self.cp.size, self.algorithm)

    @property
    def chunk_size(self) -> int:
        return self.seq_length // num_chunks(self.cp.size, self.algorithm)

    def chunks_of(self, cp_rank: int) -> tuple[int, ...]:
        return chunk_ids(cp_rank, self.cp.size, self.algorithm)

    @property
    def needs_custom_attention(self) -> bool:
        """False when plain causal attention over the local tokens is exact (no CP, no documents)."""
        return self.cp.size > 1 or self.cu_seqlens is not None

    def positions(self, device=None) -> torch.Tensor:
        """Global positions ``[s / C]`` of the local tokens."""
        return local_positions(self.seq_length, self.cp.rank, self.cp.size, self.algorithm, device)

    def segment_ids(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence (document) index of every local token and each sequence's length.

        Returns:
            ``(ids [s / C, b] int64, lengths [n] int64)``: a sequence is one sample, or one
            non-empty packed document of a sample; ids count them over the microbatch in sample
            order, so they are the same on every rank and layout.
        """
        pos = self.positions(device)
        if self.cu_seqlens is None:
            ids = torch.arange(self.batch, device=device).expand(pos.numel(), self.batch)
            return ids.contiguous(), torch.full((self.batch,), self.seq_length, device=device)
        cu = self.cu_seqlens.to(device)
        lengths = cu[:, 1:] - cu[:, :-1]                       # [b, D]
        nonempty = lengths > 0
        index = torch.cumsum(nonempty.reshape(-1), 0).view_as(lengths) - 1  # sequence id of each (b, doc)
        doc = torch.searchsorted(cu[:, 1:].contiguous(), pos.expand(cu.shape[0], -1).contiguous(), right=True)
        ids = index.gather(1, doc).t().contiguous()            # [s / C, b]
        return ids, lengths[nonempty]


def sequence_layout(ctx: ParallelContext, algorithm: str, batch: int, local_len: int,
                    position_ids: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, device=None) -> tuple[SeqLayout, torch.Tensor | None]:
    """The :class:`SeqLayout` of a microbatch and the positions of this rank's tokens.

    Args:
        ctx: the parallel context (its ``cp`` group).
        algorithm: ``parallel.context_algorithm``.
        batch, local_len: ``b`` and ``s / C`` of this rank's token ids.
        position_ids: ``[b, s / C]`` positions of this rank's tokens when they restart at each
            document (``data.reset_position_ids``), else None (global positions).
        cu_seqlens: ``[b, D + 1]`` document starts (``data.reset_attention_mask``), else None.
    Returns:
        ``(layout, positions)``: positions ``[s / C, b]`` (or ``[s / C, 1]``) int64, or None when
        they are simply ``0 .. s - 1`` (one rank, no reset), so that path stays unchanged.
    """
    layout = SeqLayout(local_len * ctx.cp.size, ctx.cp, algorithm, cu_seqlens, batch)
    if position_ids is not None:
        return layout, position_ids.t().to(device)
    if ctx.cp.size == 1:
        return layout, None
    return layout, layout.positions(device)[:, None]


SHARDED_KEYS = ("tokens", "labels", "position_ids", "mtp_tokens", "mtp_labels")
"""Microbatch fields split along the sequence over CP; ``cu_seqlens`` stays whole (global offsets)."""


def shard_microbatch(mb: dict[str, torch.Tensor], cp_rank: int, cp_size: int, algorithm: str
                     ) -> dict[str, torch.Tensor]:
    """A CP rank's part of a microbatch: its chunks of ``tokens``, ``labels`` and ``position_ids``
    (``[b, s]`` -> ``[b, s / C]``); other fields unchanged."""
    return {k: shard_sequence(v, cp_rank, cp_size, algorithm) if k in SHARDED_KEYS else v for k, v in mb.items()}
