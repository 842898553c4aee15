"""Indexed token files, byte-compatible with Megatron-LM's ``.bin``/``.idx`` (index version 1).

Layout (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, ``MMapIndexedDataset``):

``PREFIX.bin``
    the tokens of every sequence back to back, in the file's dtype (uint16 when the vocabulary has
    fewer than 65,500 entries, else int32), no header.
``PREFIX.idx`` (all little-endian)
    ``b"MMIDIDX\\x00\\x00"`` (9 bytes), version ``<Q`` = 1, dtype code ``<B``, sequence count ``<Q``,
    document count ``<Q``; then ``int32[sequence_count]`` sequence lengths (tokens),
    ``int64[sequence_count]`` byte pointers into ``.bin``, ``int64[document_count]`` document
    indices (the sequence index where each document starts, beginning with 0 and ending with
    ``sequence_count``, so ``document_count`` is the number of documents plus one).

Byte pointers and document indices are int64 because a corpus passes 2^31 bytes quickly
(3 documents of 2^30 uint16 tokens already point at byte 2^32). Without sentence splitting each
document is one sequence.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1

DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
    6: np.float64, 7: np.float32, 8: np.uint16,
}
"""Megatron's dtype codes (``DType`` enum) -> numpy dtype."""

UINT16_VOCAB_LIMIT = 65500
"""Vocabularies smaller than this are stored as uint16, as Megatron's ``DType.optimal_dtype`` does."""


def dtype_code(dtype) -> int:
    """Megatron's code for ``dtype``; raises ValueError for a dtype the format cannot hold."""
    dt = np.dtype(dtype)
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == dt:
            return code
    raise ValueError(f"dtype {dt} has no code in the Megatron index format "
                     f"(allowed: {', '.join(np.dtype(t).name for t in DTYPE_CODES.values())})")


def optimal_dtype(vocab_size: int | None) -> type:
    """uint16 for a vocabulary of fewer than 65,500 tokens, else int32 (Megatron's rule)."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.uint16
    return np.int32


def sequence_pointers(sequence_lengths: Sequence[int] | np.ndarray, dtype) -> np.ndarray:
    """Byte offset of each sequence in ``.bin``: the exclusive prefix sum of lengths times the item size.

    Args:
        sequence_lengths: tokens per sequence, shape [n].
        dtype: the token dtype of the ``.bin`` file.

    Returns:
        int64 array [n]; computed in int64 so that offsets past 2^31 bytes stay exact.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    out = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], out=out[1:])
    return out * np.dtype(dtype).itemsize


def _paths(prefix: str | os.PathLike) -> tuple[str, str]:
    p = os.fspath(prefix)
    return p + ".bin", p + ".idx"


def exists(prefix: str | os.PathLike) -> bool:
    """True when both ``PREFIX.bin`` and ``PREFIX.idx`` exist (the writer renames ``.idx`` last)."""
    b, i = _paths(prefix)
    return os.path.isfile(b) and os.path.isfile(i)


def write_index(path: str | os.PathLike, dtype, sequence_lengths, document_indices) -> None:
    """Write a version-1 ``.idx`` file describing sequences of ``dtype`` tokens.

    Args:
        path: the ``.idx`` file to write.
        dtype: token dtype of the matching ``.bin``.
        sequence_lengths: tokens per sequence, [n]; must fit int32.
        document_indices: sequence index where each document starts, [d + 1], from 0 to n.

    Raises:
        ValueError: lengths outside int32, or document indices that do not run from 0 to n.
    """
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
        raise ValueError(f"{path}: sequence lengths must be in [0, 2^31); got max {lengths.max()}")
    docs = np.asarray(document_indices, dtype=np.int64)
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or np.any(np.diff(docs) < 0):
        raise ValueError(f"{path}: document_indices must rise from 0 to the sequence count {len(lengths)}")
    with open(path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", INDEX_VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4").tobytes(order="C"))
        f.write(sequence_pointers(lengths, dtype).astype("<i8").tobytes(order="C"))
        f.write(docs.astype("<i8").tobytes(order="C"))


class IndexedDatasetWriter:
    """Append documents to ``PREFIX.bin``/``PREFIX.idx``.

    Files are written under temporary names and renamed by :meth:`finalize` (``.bin`` first, then
    ``.idx``), so a reader never sees a half-written dataset and several processes may race to
    write the same prefix. Usable as a context manager: leaving the block without an exception
    finalizes; with one, the temporaries are removed.

    Args:
        prefix: output path without extension.
        dtype: token dtype (see :func:`optimal_dtype`).
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        dtype_code(dtype)  # fail early on a dtype the index cannot name
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        self._bin, self._idx = _paths(self.prefix)
        tag = f".tmp{os.getpid()}"
        self._bin_tmp, self._idx_tmp = self._bin + tag, self._idx + tag
        Path(self._bin).parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._docs: list[int] = [0]
        self.num_tokens = 0

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one document (one sequence) of token ids."""
        self.add_sequences([tokens])

    def add_sequences(self, sequences: Sequence[Iterable[int] | np.ndarray]) -> None:
        """Append one document made of several sequences (e.g. sentences)."""
        for seq in sequences:
            arr = np.asarray(seq, dtype=self.dtype)
            self._f.write(arr.tobytes(order="C"))
            self._lengths.append(int(arr.size))
            self.num_tokens += int(arr.size)
        self._docs.append(len(self._lengths))

    def add_flat(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append ``len(lengths)`` one-sequence documents whose tokens lie back to back in ``tokens``
        (one write, for the preprocessor's batches).

        Raises:
            ValueError: ``lengths`` do not add up to ``tokens.size``.
        """
        arr = np.asarray(tokens, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"add_flat: lengths sum to {int(lengths.sum())}, tokens has {arr.size}")
        self._f.write(arr.tobytes(order="C"))
        base = len(self._lengths)
        self._lengths.extend(lengths.tolist())
        self._docs.extend(range(base + 1, base + len(lengths) + 1))
        self.num_tokens += int(arr.size)

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append every document of an existing dataset (same dtype) by copying its bytes."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{os.fspath(prefix)}.idx holds {other.dtype.name} tokens; "
                             f"this writer writes {self.dtype.name}")
        base = len(self._lengths)
        with open(_paths(prefix)[0], "rb") as src:
            shutil.copyfileobj(src, self._f, 1 << 24)
        self._lengths.extend(int(x) for x in other.sequence_lengths)
        self._docs.extend(int(d) + base for d in other.document_indices[1:])
        self.num_tokens += int(other.sequence_lengths.sum(dtype=np.int64))

    def finalize(self) -> None:
        """Write the index and move both files into place (``.idx`` last)."""
        self._f.close()
        write_index(self._idx_tmp, self.dtype, self._lengths, self._docs)
        os.replace(self._bin_tmp, self._bin)
        os.replace(self._idx_tmp, self._idx)

    def abort(self) -> None:
        """Drop the temporaries without touching existing files."""
        self._f.close()
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Memory-mapped reader of a ``PREFIX.bin``/``PREFIX.idx`` pair.

    ``len(ds)`` is the number of sequences and ``ds[i]`` the tokens of sequence ``i`` as a read-only
    numpy array [length] of the file's dtype (a slice gives a list of arrays). Documents are groups
    of consecutive sequences; :meth:`get_document` reads across them.

    Attributes:
        dtype: token dtype.
        sequence_lengths: int32 [n], tokens per sequence.
        sequence_pointers: int64 [n], byte offsets into ``.bin``.
        document_indices: int64 [d + 1], first sequence of each document, then n.
        document_lengths: int64 [d], tokens per document.
        document_starts: int64 [d], token offset of each document in ``tokens``.
        tokens: every token of ``.bin`` as one read-only array (memory-mapped).

    Raises:
        FileNotFoundError: a missing ``.idx`` or ``.bin``.
        ValueError: a bad header or version, an unknown dtype code, or a ``.bin`` shorter than the
            index says; the message names the file.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        bin_path, idx_path = _paths(self.prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"indexed dataset {self.prefix!r}: {p} does not exist")
        with open(idx_path, "rb") as f:
            head = f.read(len(INDEX_HEADER) + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != INDEX_HEADER:
            raise ValueError(f"{idx_path}: not a Megatron index (header {head[:9]!r}, "
                             f"expected {INDEX_HEADER!r})")
        version, = struct.unpack("<Q", head[9:17])
        if version != INDEX_VERSION:
            raise ValueError(f"{idx_path}: index version {version}, only {INDEX_VERSION} is supported")
        code = head[17]
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n, d = struct.unpack("<QQ", head[18:34])
        need = 34 + 4 * n + 8 * n + 8 * d
        if os.path.getsize(idx_path) < need:
            raise ValueError(f"{idx_path}: {os.path.getsize(idx_path)} bytes, but {n} sequences and "
                             f"{d} document indices need {need}")
        self._idx_map = np.memmap(idx_path, mode="r", dtype=np.uint8)
        buf = self._idx_map
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=n, offset=34)
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=n, offset=34 + 4 * n)
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=34 + 12 * n)
        total = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if os.path.getsize(bin_path) < total:
            raise ValueError(f"{bin_path}: {os.path.getsize(bin_path)} bytes, but {idx_path} "
                             f"describes {total}")
        self._bin_map = np.memmap(bin_path, mode="r", dtype=np.uint8) if total else np.zeros(0, np.uint8)
        # A plain ndarray view: slicing an np.memmap goes through Python-level overrides.
        self.tokens = np.frombuffer(self._bin_map, dtype=self.dtype, count=total // self.dtype.itemsize)
        cum = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=cum[1:])
        self.document_lengths = cum[self.document_indices[1:]] - cum[self.document_indices[:-1]]
        starts = np.append(self.sequence_pointers, total) // self.dtype.itemsize
        self.document_starts = starts[self.document_indices[:-1]]

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of sequence ``idx`` (to its end when length is None)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) out of sequence "
                             f"{idx} of length {size}")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    def get_document(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset : offset + length`` of document ``doc``, across its sequences."""
        size = int(self.document_lengths[doc])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.prefix}: tokens [{offset}, {offset + length}) out of document "
                             f"{doc} of length {size}")
        # A document's sequences are written back to back, so one contiguous slice serves.
        start = int(self.document_starts[doc]) + offset
        return self.tokens[start:start + length]

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"{self.prefix}: sequence {idx} out of range [0, {n})")
        return self.get(idx % n)


def merge_datasets(prefixes: Sequence[str | os.PathLike], out_prefix: str | os.PathLike) -> IndexedDataset:
    """Concatenate datasets of one dtype into ``out_prefix`` (documents in the given order).

    Raises:
        ValueError: no inputs, or inputs of different dtypes (the message names the file).
    """
    if not prefixes:
        raise ValueError("merge_datasets: prefixes is empty")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetWriter(out_prefix, first.dtype) as w:
        for p in prefixes:
            w.add_index(p)
    return IndexedDataset(out_prefix)
