"""Optimizer state as rectangles of each parameter's full logical tensor, for checkpoints.

Every state tensor of a param is described in the param's 2-D view ``[prod(shape[:-1]),
shape[-1]]`` (a 1-D param of ``n`` elements is ``[1, n]``), so the keys and global shapes are the
same whatever the layout (TP, PP, DP, ZeRO-1). A flat range ``[lo, hi)`` of a rank's local
tensor (all of it without ZeRO; the part inside its shard with ZeRO) covers at most three
rectangles of that view: a partial first row, whole middle rows, a partial last row. Each is a
contiguous run of the flat state, so it can be returned as a view that a loader fills in place.
Vocab padding (outside :attr:`ShardSpec.local_shape`) is left out.
"""

from __future__ import annotations

from math import prod

import torch

from ..parallel.params import ShardSpec


def _view2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return prod(shape[:-1]), shape[-1]


def rectangles(local_shape: tuple[int, ...], spec: ShardSpec, lo: int, hi: int,
               name: str = "param") -> list[tuple[int, int, ShardSpec]]:
    """The rectangles of the global 2-D view covered by flat range ``[lo, hi)`` of a local tensor.

    Args:
        local_shape: shape of the local tensor (with any vocab padding).
        spec: its :class:`ShardSpec` (padding only along dim 0).
        lo, hi: flat element range inside the local tensor.
        name: the param's logical name, for errors.

    Returns:
        ``(a, b, spec2d)`` per rectangle: the flat sub-range ``[a, b)`` of the local tensor and
        the rectangle's :class:`ShardSpec` in the global 2-D view (``local_shape`` is the
        rectangle's ``(rows, cols)``).

    Raises:
        NotImplementedError: the shard is offset or padded in a middle dim (no rectangle form).
    """
    local_shape = tuple(int(s) for s in local_shape)
    if spec.stride > 1:
        return _strided_rectangles(local_shape, spec, lo, hi, name)
    g, off, valid = spec.global_shape, spec.offsets, spec.local_shape
    rows, cols = _view2d(local_shape)
    grows, gcols = _view2d(tuple(g))
    if len(local_shape) <= 1:
        vrows, vcols = 1, (valid[0] if valid else 1)
        roff, coff = 0, (off[0] if off else 0)
    else:
        if tuple(valid[1:]) != local_shape[1:] or any(o for o in off[1:-1]) \
                or tuple(valid[1:-1]) != tuple(g[1:-1]):
            raise NotImplementedError(
                f"{name}: shard {spec} of local shape {local_shape} is offset or padded in a "
                "dim other than the first and last; it has no 2-D rectangle form")
        mid = prod(local_shape[1:-1])
        vrows, vcols = valid[0] * mid, cols
        roff, coff = off[0] * mid, off[-1]

    r0, c0 = divmod(lo, cols)
    r1, c1 = divmod(hi - 1, cols)
    c1 += 1
    if r0 == r1:
        parts = [(r0, c0, r0 + 1, c1)]
    else:
        parts = []
        first_full = r0 if c0 == 0 else r0 + 1
        last_full = r1 + 1 if c1 == cols else r1
        if c0:
            parts.append((r0, c0, r0 + 1, cols))
        if last_full > first_full:
            parts.append((first_full, 0, last_full, cols))
        if c1 < cols:
            parts.append((r1, 0, r1 + 1, c1))
    out = []
    for ra, ca, rb, cb in parts:
        rb, cb = min(rb, vrows), min(cb, vcols)
        if rb <= ra or cb <= ca:
            continue
        a = ra * cols + ca
        b = (rb - 1) * cols + cb
        out.append((a, b, ShardSpec((grows, gcols), (roff + ra, coff + ca), (rb - ra, cb - ca))))
    return out


def _strided_rectangles(local_shape: tuple[int, ...], spec: ShardSpec, lo: int, hi: int,
                        name: str) -> list[tuple[int, int, ShardSpec]]:
    """:func:`rectangles` of each contiguous block of a strided shard, in local order."""
    inner = prod(local_shape[1:])
    out = []
    for first, block in spec.blocks():
        start, end = first * inner, (first + block.local_shape[0]) * inner
        a, b = max(lo, start), min(hi, end)
        if a < b:
            part = rectangles(block.local_shape, block, a - start, b - start, name)
            out += [(x + start, y + start, r) for x, y, r in part]
    return out


def chunk_views(flat: torch.Tensor, lo: int, rects) -> list[tuple[torch.Tensor, ShardSpec]]:
    """Views of ``flat`` (the state of local flat range starting at ``lo``) shaped as the
    rectangles from :func:`rectangles`."""
    out = []
    for a, b, spec in rects:
        out.append((flat[a - lo:b - lo].view(spec.local_shape), spec))
    return out


def copy_param_into_views(param: torch.Tensor, views) -> None:
    """Fill state ``views`` (``(view, ShardSpec)`` rectangles of ``param``'s 2-D view, as
    ``Optimizer.sharded_state_dict`` lists them) from the param's own values."""
    blocks = _param_blocks_2d(param)
    for view, spec in views:
        (r, c), (nr, nc) = spec.offsets, spec.local_shape
        # A rectangle lies inside one block (one, unless the shard is strided).
        local2d, roff, coff = next(b for b in blocks if b[1] <= r < b[1] + b[0].shape[0]
                                   and b[2] <= c < b[2] + b[0].shape[1])
        copy_aliased_(view, local2d[r - roff:r - roff + nr, c - coff:c - coff + nc])


def copy_aliased_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, also where the two share memory.

    In fp32 the optimizer's main weights are the params' own storage, so a main-weight chunk and
    the param rectangle it is filled from are the same elements; where a ZeRO shard boundary cuts
    a row, the chunk is a ``[1, k]`` view with another (irrelevant) row stride, which
    ``Tensor.copy_`` refuses as a partial overlap. The same elements: nothing to copy. Any other
    overlap: through a copy of ``src``.
    """
    if dst.numel() and src.numel() and dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr():
        if dst.dtype == src.dtype and _same_elements(dst, src):
            return
        src = src.clone()
    dst.copy_(src)


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two views of one storage address the same elements in the same order (the
    strides of size-1 dims never matter)."""
    if a.shape != b.shape or a.storage_offset() != b.storage_offset():
        return False
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def _param_blocks_2d(p) -> list[tuple[torch.Tensor, int, int]]:
    """The valid part of ``p`` as 2-D views, one per contiguous block of its shard, each with
    its row/column offset in the full 2-D view."""
    spec = p.meta.shard
    valid = spec.valid(p.detach())
    out = []
    for first, block in spec.blocks():
        v = valid[first:first + block.local_shape[0]] if spec.stride > 1 else valid
        if v.dim() == 0:
            out.append((v.reshape(1, 1), 0, 0))
        elif v.dim() == 1:
            out.append((v.reshape(1, -1), 0, block.offsets[0]))
        else:
            mid = prod(v.shape[1:-1])
            out.append((v.reshape(-1, v.shape[-1]), block.offsets[0] * mid, block.offsets[-1]))
    return out
