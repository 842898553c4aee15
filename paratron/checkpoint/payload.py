"""A rank's DCP payload files (``__<r>_<i>.distcp``), written byte for byte as DCP's
``FileSystemWriter`` writes them, at the cost of a raw write.

DCP writes each tensor with its own ``torch.save`` (a small zip: pickle, version records, the
storage's bytes, a directory) into the rank's file, and records where each zip starts and how
long it is; readers ``torch.load`` that range. ``torch.save`` spends its time, beyond copying the
storage, on pickling and some forty small writes per tensor, the same for every tensor of one
layout. With its record CRC-32 switched off (:func:`no_record_crc32`), the bytes before and after
the storage depend on the tensor's layout alone (dtype, shape, strides, storage offset and size),
not on its values. So :class:`ZipTemplates` runs ``torch.save`` once per distinct layout, keeps
the bytes around the storage, and :class:`PayloadFile` writes every tensor as ``head, storage,
tail`` with one ``writev`` straight from the tensor's memory: no copy, no pickling, and a file
that DCP's own reader, ``torch.load`` and paratron's reader
(:mod:`paratron.checkpoint.checksummed`) read as before (``tests/test_checkpoint_payload.py``
compares the bytes with ``torch.save``'s for many layouts, and with DCP's writer's). A tensor whose layout the template
cannot describe (a subclass, a storage it does not hand over as one write) is written with its
own ``torch.save``, as DCP would.

The written buffers are kept (views of the tensors' storages, the small pieces as they are), so
the file's block CRCs (:class:`~paratron.checkpoint.integrity.BlockCrc`) are computed from the
same memory that was written, while the file's fsync runs: one pass over bytes already in
memory, never a second read of the file.
"""

from __future__ import annotations

import io
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from . import integrity
from .finite import all_finite

IOV_MAX = 1024  # the most buffers one writev takes (Linux)


@contextmanager
def no_record_crc32():
    """``torch.save`` writes its zip records without their CRC-32 for the duration (restored after).

    ``torch.load`` never checks that CRC, so it was a second checksum pass over the bytes that
    protected nothing (the block CRCs cover every byte of the file); without it the bytes around a
    storage depend only on the tensor's layout. Process-wide (torch keeps one setting); a process
    runs one checkpoint save at a time.
    """
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def storage_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t``'s whole untyped storage (what ``torch.save`` writes), without a copy."""
    s = t.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
    return memoryview(whole.numpy()).cast("B")


def storage_elements(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t``'s whole storage in storage order, 1-D, without a copy (``t`` fills
    its storage: :func:`prepared`)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (t.numel(),))


class _Capture:
    """A file-like ``torch.save`` writes into: the pieces it writes, copied, except the one write
    that hands over the storage ``(address, nbytes)`` itself, whose index is kept (:attr:`split`)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self._address, self._nbytes = address, nbytes
        self.pieces: list[bytes] = []
        self.split: int | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.split is None and self._nbytes and len(view) == self._nbytes and _address(view) == self._address:
            self.split = len(self.pieces)
            self.pieces.append(b"")
        else:
            self.pieces.append(bytes(view))
        return len(view)

    def flush(self) -> None:
        """Nothing to flush: ``torch.save`` calls it, and the pieces are already held in memory."""


class ZipTemplates:
    """The bytes ``torch.save`` writes before and after a tensor's storage, per tensor layout,
    learnt with one ``torch.save`` of the first tensor of each layout (record CRCs off)."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[bytes, bytes] | None] = {}

    @staticmethod
    def layout(t: torch.Tensor) -> tuple | None:
        """What the bytes around the storage depend on; None where it is not only that (a tensor
        subclass may pickle more)."""
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.requires_grad:
            return None
        return (t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.untyped_storage().nbytes(),
                t.is_conj(), t.is_neg(), sys.byteorder, torch.serialization._get_storage_alignment())

    def pieces(self, t: torch.Tensor) -> list:
        """The buffers whose concatenation is ``torch.save(t)`` with record CRCs off: ``[head,
        storage bytes, tail]``, or ``[torch.save's own bytes]`` where no template applies."""
        key = self.layout(t)
        if key is not None and key in self._known and self._known[key] is not None:
            head, tail = self._known[key]
            return [head, storage_bytes(t), tail]
        s = t.untyped_storage()
        cap = _Capture(s.data_ptr(), s.nbytes())
        with no_record_crc32():
            torch.save(t, cap)
        if cap.split is None and s.nbytes():  # the storage went out in pieces: no template
            if key is not None:
                self._known[key] = None
            return [b"".join(cap.pieces)]
        at = len(cap.pieces) if cap.split is None else cap.split
        head, tail = b"".join(cap.pieces[:at]), b"".join(cap.pieces[at + 1:])
        if key is not None:
            self._known[key] = (head, tail)
        return [head, storage_bytes(t), tail]


def _writev_all(fd: int, buffers: list) -> None:
    """Write ``buffers`` in order (short writes resumed, at most ``IOV_MAX`` buffers a call)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        n = os.writev(fd, views[:IOV_MAX])
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def prepared(planner, item) -> torch.Tensor:
    """The tensor DCP would write for ``item``: detached, on the CPU, and copied where it is a
    view of a larger storage (``torch.save`` writes whole storages)."""
    t = planner.resolve_data(item).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class PayloadFile:
    """One payload file: laid out (:meth:`add`), written (:meth:`flush`), then checksummed and
    checked (:meth:`scan`).

    Args:
        path: the file (created; truncated if it exists).
        name: its name in the checkpoint directory (DCP's ``relative_path``).
        templates: the :class:`ZipTemplates` to write tensors with (shared across saves).

    Attributes:
        fd: the open file descriptor (the caller fsyncs and closes it, :meth:`close`).
    """

    def __init__(self, path: Path, name: str, templates: ZipTemplates) -> None:
        self.name, self._templates = name, templates
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        # (buffer written or None, item key, the storage's elements where they are to be checked)
        self._pieces: list[tuple] = []
        self._pos = 0

    def close(self) -> None:
        os.close(self.fd)

    def add(self, items, planner) -> list[WriteResult]:
        """Lay out every item of a bucket of a rank's plan: byte items as they are, tensors as
        ``torch.save`` would (see the module); returns DCP's write results (where each item's bytes
        will lie). Nothing is written until :meth:`flush`; the templates are learnt here, on the
        calling thread (``torch.save`` reads a process-wide setting)."""
        results = []
        for item in items:
            flat = None
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                pieces = [data.getbuffer() if isinstance(data, io.BytesIO) else bytes(data)]
            else:
                t = prepared(planner, item)
                pieces = self._templates.pieces(t)
                flat = storage_elements(t)
            length = sum(len(memoryview(p).cast("B")) for p in pieces)
            self._pieces += [(p, item.index.fqn, None) for p in pieces]
            if flat is not None:  # the storage's bytes (a tensor's one memoryview) go with its elements
                at = next((j for j, p in enumerate(pieces) if isinstance(p, memoryview)), None)
                if at is None:  # written by torch.save itself: its elements are checked on their own
                    self._pieces.append((None, item.index.fqn, flat))
                else:
                    self._pieces[at - len(pieces)] = (pieces[at], item.index.fqn, flat)
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(self.name, self._pos, length)))
            self._pos += length
        return results

    def flush(self) -> None:
        """Write everything laid out, in order, with ``writev`` straight from the buffers (it
        releases the GIL: files of one rank can be written by threads at once)."""
        _writev_all(self.fd, [p for p, _, _ in self._pieces if p is not None])

    def scan(self, block: int, check_finite: bool) -> tuple[integrity.BlockCrc, str | None]:
        """The block CRCs of everything written, computed from the written buffers (call while
        the tensors are alive), and with ``check_finite`` the first key (in key order) of the
        written tensors that holds an inf or NaN (None: none does).

        One pass over each tensor's memory: it is taken in ``integrity.SCAN``-byte pieces, each
        checksummed and then checked (:func:`~paratron.checkpoint.finite.all_finite`) while still
        in the CPU's cache, rather than two passes over the whole state from memory. Consecutive small pieces
        (zip headers) are joined first, so the CRC is called a few times per tensor, not once per
        header."""
        crc = integrity.BlockCrc(block)
        bad: set[str] = set()
        small: list[bytes] = []
        for piece, key, flat in self._pieces:
            if piece is None:
                if check_finite and key not in bad and not all_finite(flat):
                    bad.add(key)
                continue
            if isinstance(piece, bytes):
                small.append(piece)
                continue
            if small:
                crc.update(b"".join(small))
                small = []
            if flat is None:
                crc.update(piece)
                continue
            step = max(1, integrity.SCAN // flat.element_size())
            for i in range(0, flat.numel(), step):
                crc.update(piece[i * flat.element_size():(i + step) * flat.element_size()])
                if check_finite and key not in bad and not all_finite(flat[i:i + step]):
                    bad.add(key)
        if small:
            crc.update(b"".join(small))
        self._pieces = []
        return crc, min(bad) if bad else None
