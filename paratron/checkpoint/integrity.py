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

import json
import os
import re
import zlib
from pathlib import Path
from typing import Iterable

from .items import CheckpointError

CHECKSUMS = "checksums"
SELF_FIELD = "manifest_crc32"
_PLACEHOLDER = "0" * 8
_SELF = re.compile(rb'"manifest_crc32": "([0-9a-f]{8})"')
BLOCK = 4 << 20


def file_crc32(path: str | os.PathLike) -> tuple[str, int]:
    """``(crc32 as 8 hex digits, size in bytes)`` of a file, read in 4 MiB blocks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return f"{crc:08x}", size


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
