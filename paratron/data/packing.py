"""Packed documents: positions, document boundaries and loss masks from end-of-document tokens,
as Megatron-LM's ``--reset-position-ids``, ``--reset-attention-mask`` and ``--eod-mask-loss``.

A GPT sample is a window of ``s`` tokens cut across documents; each document ends with the
end-of-document token (``eod``), which belongs to the document it closes. Nothing here builds an
``[s, s]`` mask: documents are described by their start offsets per sample (``cu_seqlens``, as in
variable-length attention kernels), and attention works on per-document rectangles
(:mod:`paratron.models.context_parallel.layout`).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def document_starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``cu_seqlens`` ``[b, D + 1]`` int64 of token ids ``[b, s]``: per sample, 0, the position
    after each end-of-document token (except the last position), then ``s``; shorter rows are
    padded with ``s`` (empty documents)."""
    b, s = tokens.shape
    rows = []
    for row in tokens:
        ends = (row[:-1] == eod).nonzero().flatten() + 1
        rows.append(torch.cat([torch.zeros(1, dtype=torch.int64), ends.to(torch.int64),
                               torch.full((1,), s, dtype=torch.int64)]))
    width = max(r.numel() for r in rows)
    return torch.stack([torch.cat([r, torch.full((width - r.numel(),), s, dtype=torch.int64)]) for r in rows])


def reset_positions(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """``[b, s]`` int64 positions that restart at 0 at every document start of ``cu_seqlens``."""
    pos = torch.arange(seq_length, dtype=torch.int64).expand(cu_seqlens.shape[0], -1)
    doc = torch.searchsorted(cu_seqlens[:, 1:].contiguous(), pos.contiguous(), right=True)
    return pos - cu_seqlens.gather(1, doc)


def pack_microbatch(mb: dict[str, torch.Tensor], eod: int, *, reset_position_ids: bool = False,
                    reset_attention_mask: bool = False, eod_mask_loss: bool = False) -> dict[str, torch.Tensor]:
    """Add the packed-document fields to a microbatch ``{"tokens": [b, s], "labels": [b, s]}``.

    Returns a new dict: ``position_ids`` ``[b, s]`` (``reset_position_ids``), ``cu_seqlens``
    ``[b, D + 1]`` (``reset_attention_mask``), and ``labels`` set to -100 where the *input* token is
    ``eod`` (``eod_mask_loss``, Megatron's convention: no loss on predicting across a boundary).
    """
    out = dict(mb)
    tokens = mb["tokens"]
    if reset_position_ids or reset_attention_mask:
        cu = document_starts(tokens, eod)
        if reset_position_ids:
            out["position_ids"] = reset_positions(cu, tokens.shape[1])
        if reset_attention_mask:
            out["cu_seqlens"] = cu
    if eod_mask_loss:
        out["labels"] = mb["labels"].masked_fill(tokens == eod, IGNORE_INDEX)
    return out
