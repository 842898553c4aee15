"""Checksums of every file of a checkpoint, written at save time and verified on load.

A bit flipped by a disk, a copy cut short, or a file edited by hand must be refused with the
file's name, not loaded as silently different weights or reported as an unpickling error deep
inside ``torch.load``. At save time each rank checksums the files it wrote (its DCP payload
``__<r>_*.distcp`` and its ``rank_<r>.json``, still in the page cache) and rank 0 the shared ones
(``.metadata``, ``config.toml``); the manifest ``paratron.json`` lists them all as
``{"name": [crc32 hex, size]}`` and carries a checksum of its own bytes in ``manifest_crc32``
(computed with that field's value zeroed, so the manifest stays plain JSON).

On load, :func:`check_manifest` verifies the manifest's own bytes and :func:`verify_files` the
files a rank reads (the small shared files on every load; each payload file by the ranks that
read it, just before DCP reads it). CRC-32 (zlib) because it runs at memory speed and catches
every 1-bit and short burst error; it is not a defence against deliberate tampering (loading
never unpickles, see :mod:`paratron.checkpoint.safety`). Cost: ``benchmarks/bench_checkpoint.py``.

Checkpoints written before checksums existed have neither field and are loaded unverified.
"""

from __future__ import annotations

import functools
import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from .items import CheckpointError

CHECKSUMS = "checksums"
SELF_FIELD = "manifest_crc32"
_PLACEHOLDER = "0" * 8
_SELF = re.compile(rb'"manifest_crc32": "([0-9a-f]{8})"')
BLOCK = 4 << 20


def file_crc32(path: str | os.PathLike, threads: int | None = None) -> tuple[str, int]:
    """``(crc32 as 8 hex digits, size in bytes)`` of a file: the CRC-32 of its whole content,
    computed over 4 MiB blocks on ``threads`` threads (zlib releases the GIL; default: half the
    usable CPUs, 1 to 4, since the ranks of a node share them) and folded into one value with
    :func:`crc32_combine`."""
    size = os.path.getsize(path)
    starts = range(0, size, BLOCK)
    fd = os.open(path, os.O_RDONLY)
    try:
        def block_crc(start: int) -> int:
            return zlib.crc32(os.pread(fd, min(BLOCK, size - start), start))

        if len(starts) <= 1:
            crcs = [block_crc(s) for s in starts]
        else:
            with ThreadPoolExecutor(threads or min(4, max(1, len(os.sched_getaffinity(0)) // 2))) as pool:
                crcs = list(pool.map(block_crc, starts))
    finally:
        os.close(fd)
    crc = crcs[0] if crcs else 0
    for i, c in enumerate(crcs[1:], start=1):
        crc = crc32_combine(crc, c, min(BLOCK, size - starts[i]))
    return f"{crc:08x}", size


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
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The linear map that advances a (raw) CRC-32 register over ``nbytes`` zero bytes."""
    bit = (0xEDB88320,) + tuple(1 << n for n in range(31))  # one zero bit: shift, reduce by the polynomial
    base = _square(_square(_square(bit)))                    # one zero byte
    result = tuple(1 << n for n in range(32))                # identity
    while nbytes:
        if nbytes & 1:
            result = tuple(_times(base, row) for row in result)
        base = _square(base)
        nbytes >>= 1
    return result


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's crc32_combine,
    which Python does not expose): the pre- and post-conditioning cancel, leaving ``crc(A)``
    advanced over ``len(B)`` zero bytes, xor ``crc(B)``."""
    return _times(_zeros_operator(len_b), crc_a) ^ crc_b


def checksum_files(directory: str | os.PathLike, names: Iterable[str]) -> dict[str, list]:
    """``{name: [crc32 hex, size]}`` for the named files of ``directory``."""
    return {n: list(file_crc32(Path(directory) / n)) for n in names}


def own_files(directory: str | os.PathLike, rank: int) -> list[str]:
    """The files rank ``rank`` writes into a checkpoint directory: its DCP payload and rank state."""
    d = Path(directory)
    names = sorted(p.name for p in d.glob(f"__{rank}_*.distcp"))
    if (d / f"rank_{rank:05d}.json").is_file():
        names.append(f"rank_{rank:05d}.json")
    return names


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


def verify_files(directory: str | os.PathLike, checksums: dict, names: Iterable[str], rank: int) -> None:
    """Recompute and compare the checksums of ``names`` (files of ``directory``).

    Raises:
        CheckpointError: a file missing, of another size (truncated or extended) or with another
            CRC-32 than at save time; the message names the file and the rank that read it.
    """
    for name in names:
        path = Path(directory) / name
        want = checksums.get(name)
        if want is None:
            raise CheckpointError(f"{path}: not listed in the manifest's checksums (read by rank {rank}); "
                                  "refusing a file the save did not write")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (read by rank {rank}); the checkpoint is incomplete")
        crc, size = file_crc32(path)
        if size != want[1]:
            what = "truncated" if size < want[1] else "longer than written"
            raise CheckpointError(f"{path}: {what}: {size:,} bytes, {want[1]:,} were written (read by rank {rank})")
        if crc != want[0]:
            raise CheckpointError(f"{path}: checksum mismatch: crc32 {crc}, {want[0]} at save time (read by rank "
                                  f"{rank}); the file is corrupt")


def reading_rank() -> int:
    """This process's global rank for messages (0 without ``torch.distributed``)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
