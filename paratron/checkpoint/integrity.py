"""Checksums of every file of a checkpoint, written at save time and verified on load.

A bit flipped by a disk, a copy cut short, or a file edited by hand must be refused with the
file's name, not loaded as silently different weights or reported as an unpickling error deep
inside ``torch.load``. Each rank checksums its DCP payloads ``__<r>_*.distcp`` as it writes them
(:class:`BlockCrc`, fed by :mod:`paratron.checkpoint.checksummed`) and its ``rank_<r>.json``, and
rank 0 the shared files (``.metadata``, ``config.toml``); the manifest ``paratron.json`` lists them
all as ``{"name": [checksum hex, size, block, block checksums]}`` (:func:`block_entry`), names
the algorithm in ``checksum`` (:data:`CURRENT` for new saves), and carries a zlib CRC-32 of its
own bytes in ``manifest_crc32`` (computed with that field's value zeroed, so the manifest stays
plain JSON; the manifest is a few kB, so its own checksum's speed does not matter).

On load, :func:`check_manifest` verifies the manifest's own bytes and :func:`verify_files` the
small shared files; payload bytes are verified block by block as they are read
(:class:`paratron.checkpoint.checksummed.StreamedFile`, or ``BlockReader`` for the reads DCP
reshapes), by the ranks that read them. New saves use XXH3-64 (the ``xxhash`` library): about
twice CRC-32C's speed here, so that checking each piece just read costs little beside the read
itself; a random corruption goes unnoticed with probability 2^-64, though unlike a CRC it has no
guarantee for short bursts. Neither is a defence against deliberate tampering (loading never
unpickles, see :mod:`paratron.checkpoint.safety`). Cost: ``benchmarks/bench_checkpoint.py``.

Older checkpoints still load: a manifest naming ``crc32c`` was written with CRC-32C (the
Castagnoli polynomial, by the ``google-crc32c`` library's C extension), one without the
``checksum`` field with zlib's CRC-32; entries written before block checksums have two fields
(their payloads are verified whole); checkpoints written before checksums existed have no
checksums and load unverified.
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import google_crc32c
import numpy as np
import xxhash

from .items import CheckpointError

CHECKSUMS = "checksums"
ALGORITHM_FIELD = "checksum"
SELF_FIELD = "manifest_crc32"
_PLACEHOLDER = "0" * 8
_SELF = re.compile(rb'"manifest_crc32": "([0-9a-f]{8})"')
BLOCK = 4 << 20
SCAN = 1 << 20  # bytes checksummed and checked at a time on a save, so that each pass finds them in the CPU's cache
# Bytes read and checksummed at a time on a load. Smaller than SCAN: the kernel's copy into the
# destination touches both the page cache and the destination, so a 1 MiB piece no longer sits in
# a core's cache when the checksum reaches it. At 4 ranks on 2 cores (2 MiB of L2 a core) a 64 MiB
# read + CRC-32C took 25-26 ms in 128-256 KiB pieces against 32 ms in 1 MiB ones (readinto alone
# 18-22); with XXH3-64 the piece size matters less (18.0 ms at 256 KiB, 18.4 at 1 MiB, read alone 17.0).
READ_SCAN = 256 << 10
CRC32_POLYNOMIAL, CRC32C_POLYNOMIAL = 0xEDB88320, 0x82F63B78  # reflected generators (zlib; Castagnoli)


@dataclass(frozen=True)
class Algorithm:
    """A block checksum, fed in pieces: ``state = start()``, then ``state = extend(state,
    bytes-like)`` per piece, then ``value(state)`` (an int of ``digits`` hex digits); and
    ``whole(block values, block sizes)``, the checksum of a file from those of its blocks, in order
    (what a whole-file check recomputes, :func:`block_entry`)."""

    name: str
    start: Callable[[], object]
    extend: Callable[[object, object], object]
    value: Callable[[object], int]
    digits: int
    whole: Callable[[list[int], list[int]], int]


def _crc_algorithm(name: str, extend: Callable[[int, object], int], polynomial: int) -> Algorithm:
    """A 32-bit reflected CRC (state: the CRC so far, from 0); a file's checksum is the CRC of
    its whole content, combined from its blocks' (:func:`crc32_combine` with the reflected
    generator ``polynomial``)."""
    def whole(values: list[int], sizes: list[int]) -> int:
        crc = values[0] if values else 0
        for v, n in zip(values[1:], sizes[1:]):
            crc = crc32_combine(crc, v, n, polynomial)
        return crc

    return Algorithm(name, int, extend, lambda crc: crc, 8, whole)


def _zlib_crc32(crc: int, data) -> int:
    return zlib.crc32(data, crc)


def _crc32c(crc: int, data) -> int:
    """CRC-32C by google-crc32c's C extension. It parses its argument as ``y#``, which refuses
    memoryviews and bytearrays; a numpy view of the same memory passes without a copy (bytes pass
    as they are). It holds the GIL while it runs (its C source has no ``Py_BEGIN_ALLOW_THREADS``);
    reader threads overlap their reads, which release it, with one another's checksums."""
    if google_crc32c.implementation != "c":
        raise CheckpointError("google-crc32c is installed without its C extension (implementation "
                              f"{google_crc32c.implementation!r}); checkpoint checksums would run at Python "
                              "speed; reinstall it from a wheel for this platform")
    if not isinstance(data, bytes):
        data = np.frombuffer(data, dtype=np.uint8)
    return google_crc32c.extend(crc, data)


def _xxh3_extend(state, data):
    state.update(data)  # takes any buffer, memoryviews included, without a copy
    return state


def _xxh3_whole(values: list[int], sizes: list[int]) -> int:
    """XXH3-64 of the blocks' XXH3-64 values (8 bytes each, little-endian, in order): a hash
    list, since XXH3 values of parts do not combine into the value of the whole."""
    return xxhash.xxh3_64_intdigest(b"".join(v.to_bytes(8, "little") for v in values))


ALGORITHMS = {a.name: a for a in (
    _crc_algorithm("crc32", _zlib_crc32, CRC32_POLYNOMIAL),
    _crc_algorithm("crc32c", _crc32c, CRC32C_POLYNOMIAL),
    Algorithm("xxh3_64", xxhash.xxh3_64, _xxh3_extend, lambda h: h.intdigest(), 16, _xxh3_whole),
)}
CURRENT = ALGORITHMS["xxh3_64"]  # what new saves use (the one place that chooses it)
LEGACY = ALGORITHMS["crc32"]    # manifests without ALGORITHM_FIELD


def manifest_algorithm(manifest: dict, path: str | os.PathLike) -> Algorithm:
    """The algorithm a manifest's checksums were computed with.

    Raises:
        CheckpointError: ``checksum`` names an algorithm this paratron does not know (naming the
            manifest ``path`` and the known ones).
    """
    name = manifest.get(ALGORITHM_FIELD, LEGACY.name)
    if name not in ALGORITHMS:
        raise CheckpointError(f"{path}: checksum algorithm {name!r} is unknown; this paratron reads "
                              f"{', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name]


def file_crc32(path: str | os.PathLike, threads: int | None = None,
               algorithm: Algorithm = CURRENT) -> tuple[str, int]:
    """``(checksum in hex, size in bytes)`` of a file (for a CRC: the CRC of its whole content)."""
    crc, size = file_checksum(path, threads, algorithm)[:2]
    return crc, size


def file_checksum(path: str | os.PathLike, threads: int | None = None, algorithm: Algorithm = CURRENT,
                  block: int | None = None) -> list:
    """The manifest entry ``[checksum hex, size, block, block checksums]`` of a file (see
    :func:`block_entry`), read in ``block``-byte blocks (default ``BLOCK``) on ``threads`` threads
    (the reads release the GIL, and zlib's CRC-32 too; default: half the usable CPUs, 1 to 4,
    since the ranks of a node share them)."""
    size = os.path.getsize(path)
    block = block or BLOCK
    starts = range(0, size, block)
    fd = os.open(path, os.O_RDONLY)
    try:
        def block_crc(start: int) -> int:
            return algorithm.value(algorithm.extend(algorithm.start(), os.pread(fd, min(block, size - start), start)))

        if len(starts) <= 1:
            crcs = [block_crc(s) for s in starts]
        else:
            with ThreadPoolExecutor(threads or min(4, max(1, len(os.sched_getaffinity(0)) // 2))) as pool:
                crcs = list(pool.map(block_crc, starts))
    finally:
        os.close(fd)
    return block_entry(crcs, size, block, algorithm)


class BlockCrc:
    """The checksum (``algorithm``) of every ``block``-byte block of a byte stream fed in order
    (:meth:`update`), so that a reader can verify any range it reads by the blocks it overlaps.
    One pass over the bytes, no copy: the writer hashes the buffers it is handed as it writes them."""

    def __init__(self, block: int, algorithm: Algorithm = CURRENT) -> None:
        self.block, self.algorithm = block, algorithm
        self.crcs: list[int] = []
        self.size = 0
        self._crc = algorithm.start()
        self._fill = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.size += len(view)
        while len(view):
            take = min(len(view), self.block - self._fill)
            self._crc = self.algorithm.extend(self._crc, view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == self.block:
                self.crcs.append(self.algorithm.value(self._crc))
                self._crc, self._fill = self.algorithm.start(), 0

    def entry(self) -> list:
        """The manifest entry of the bytes fed so far (:func:`block_entry`)."""
        last = [self.algorithm.value(self._crc)] if self._fill else []
        return block_entry(self.crcs + last, self.size, self.block, self.algorithm)


def block_entry(crcs: list[int], size: int, block: int, algorithm: Algorithm) -> list:
    """``[checksum of the whole file in hex, size, block, the blocks' checksums as one string of
    hex values]``, all by ``algorithm`` (the manifest names it), each value ``algorithm.digits``
    hex digits. The first two are what every reader verifies a whole file against (entries of
    checkpoints written before block checksums have only these two); the last two let a reader
    verify just the blocks it reads (:class:`paratron.checkpoint.checksummed.BlockReader`)."""
    sizes = [min(block, size - i * block) for i in range(len(crcs))]
    digits = algorithm.digits
    return [f"{algorithm.whole(crcs, sizes):0{digits}x}", size, block, "".join(f"{c:0{digits}x}" for c in crcs)]


def entry_blocks(entry, algorithm: Algorithm = CURRENT) -> tuple[int, list[int]] | None:
    """``(block, [checksum of each block])`` of a manifest entry by ``algorithm`` (the manifest's:
    it sets the values' width); None for a two-field entry."""
    if not isinstance(entry, (list, tuple)) or len(entry) < 4:
        return None
    block, text, n = int(entry[2]), str(entry[3]), algorithm.digits
    return block, [int(text[i:i + n], 16) for i in range(0, len(text), n)]


def _times(matrix: tuple[int, ...], vector: int) -> int:
    """GF(2) matrix (32 rows as ints) times a 32-bit vector."""
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, row) for row in matrix)


@functools.lru_cache(maxsize=16)
def _zeros_operator(nbytes: int, polynomial: int) -> tuple[int, ...]:
    """The linear map that advances a (raw) CRC register over ``nbytes`` zero bytes."""
    bit = (polynomial,) + tuple(1 << n for n in range(31))  # one zero bit: shift, reduce by the polynomial
    base = _square(_square(_square(bit)))                    # one zero byte
    result = tuple(1 << n for n in range(32))                # identity
    while nbytes:
        if nbytes & 1:
            result = tuple(_times(base, row) for row in result)
        base = _square(base)
        nbytes >>= 1
    return result


def crc32_combine(crc_a: int, crc_b: int, len_b: int, polynomial: int = CRC32_POLYNOMIAL) -> int:
    """CRC of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` for a reflected 32-bit CRC with
    all-ones pre- and post-conditioning (CRC-32, CRC-32C) given its reflected ``polynomial``
    (zlib's crc32_combine, which Python does not expose): the conditionings cancel, leaving
    ``crc(A)`` advanced over ``len(B)`` zero bytes, xor ``crc(B)``."""
    return _times(_zeros_operator(len_b, polynomial), crc_a) ^ crc_b


def checksum_files(directory: str | os.PathLike, names: Iterable[str],
                   algorithm: Algorithm = CURRENT) -> dict[str, list]:
    """``{name: manifest entry}`` (:func:`block_entry`) for the named files of ``directory``."""
    return {n: file_checksum(Path(directory) / n, algorithm=algorithm) for n in names}


def seal_manifest(manifest: dict) -> bytes:
    """The manifest as JSON bytes whose ``manifest_crc32`` is the CRC-32 of those same bytes with
    the field's value zeroed."""
    body = dict(manifest, **{SELF_FIELD: _PLACEHOLDER})
    raw = json.dumps(body, indent=1, sort_keys=True, allow_nan=True).encode()
    crc = f"{zlib.crc32(raw):08x}".encode()
    return raw.replace(f'"{SELF_FIELD}": "{_PLACEHOLDER}"'.encode(), b'"%s": "%s"' % (SELF_FIELD.encode(), crc), 1)


def check_manifest(path: str | os.PathLike, raw: bytes, manifest: dict, rank: int) -> None:
    """Verify the manifest's own checksum (nothing to verify for a manifest without checksums).

    Raises:
        CheckpointError: the bytes differ from those written, naming the file and the rank.
    """
    if SELF_FIELD not in manifest and CHECKSUMS not in manifest:
        return  # written before checksums existed
    m = _SELF.search(raw)
    if m is not None:
        zeroed = raw[:m.start(1)] + _PLACEHOLDER.encode() + raw[m.end(1):]
        if f"{zlib.crc32(zeroed):08x}".encode() == m.group(1):
            return
    raise CheckpointError(f"{path}: its checksum does not match its contents (changed after it was "
                          f"written; read by rank {rank}); refusing to load a corrupt checkpoint")


def verify_files(directory: str | os.PathLike, checksums: dict, names: Iterable[str], rank: int,
                 algorithm: Algorithm) -> None:
    """Recompute (by ``algorithm``, the manifest's) and compare the checksums of ``names`` (files
    of ``directory``), whole.

    Raises:
        CheckpointError: a file missing, of another size (truncated or extended) or with another
            checksum than at save time; the message names the file, the algorithm and the rank.
    """
    for name in names:
        path = Path(directory) / name
        want = listed(checksums, path, rank)
        check_size(path, want[1], rank)
        crc = file_checksum(path, algorithm=algorithm, block=int(want[2]) if len(want) >= 4 else None)[0]
        if crc != want[0]:
            raise CheckpointError(f"{path}: checksum mismatch: {algorithm.name} {crc}, {want[0]} at save time "
                                  f"(read by rank {rank}); the file is corrupt")


def listed(checksums: dict, path: Path, rank: int) -> list:
    """The manifest entry of ``path``.

    Raises:
        CheckpointError: the manifest does not list it.
    """
    want = checksums.get(path.name)
    if want is None:
        raise CheckpointError(f"{path}: not listed in the manifest's checksums (read by rank {rank}); "
                              "refusing a file the save did not write")
    return want


def check_size(path: Path, size: int, rank: int) -> None:
    """Raises:
        CheckpointError: ``path`` is missing, or is not ``size`` bytes long (truncated or extended).
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (read by rank {rank}); the checkpoint is incomplete")
    have = path.stat().st_size
    if have != size:
        what = "truncated" if have < size else "longer than written"
        raise CheckpointError(f"{path}: {what}: {have:,} bytes, {size:,} were written (read by rank {rank})")


def reading_rank() -> int:
    """This process's global rank for messages (0 without ``torch.distributed``)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
