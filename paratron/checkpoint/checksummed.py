"""DCP file storage that checksums payloads as it writes them and verifies just what it reads.

Save: :class:`ChecksummingWriter` is DCP's ``FileSystemWriter`` with its payload writing
replaced: each rank writes its payload files (``__<r>_<i>.distcp``, ``FILES_PER_RANK`` of them
at once, a thread each) with
:class:`~paratron.checkpoint.payload.PayloadFile`, the bytes DCP's ``torch.save`` per tensor
would write, from one ``writev`` per tensor straight from its memory. Once the file is written its
fsync starts on a thread, and meanwhile the block CRCs (the CRC of each ``integrity.BLOCK``-byte
block, by ``integrity.CURRENT``) are computed from the same buffers that were written and the
written tensors are scanned for an inf or NaN. So the checksums cost one pass over bytes already
in memory, never a second read of the file, and the writer hands the manifest entries back
(:attr:`sums`).

Load, the usual case (:class:`StreamedFile`): each saved chunk's data is read straight into the
tensor being loaded; every block the rank needs is read once, ``integrity.READ_SCAN`` bytes at a time
with ``preadv`` scattering them into their destinations, each piece checksummed just after it is
read, while in the CPU's cache, and the block's CRC compared with its save-time one (by the
manifest's algorithm), on reader threads. Where the wanted part of a chunk is not contiguous
in the file or its destination not a contiguous CPU tensor of its dtype, DCP's ``torch.load``
reads the chunk through a :class:`VerifiedRange` over a :class:`BlockReader`, which verifies each
block before its bytes are used. Either way a rank reads, and verifies, only the saved chunks its
own chunks overlap, each byte once, plus at most the rest of the two edge blocks of each range.

Why a writer subclass and a view rather than DCP's stream-transform extensions: an extension is
recorded in the metadata by name and must be registered with every reader, and it sees neither the
file offsets nor the reads' positions that block checksums need.
"""

from __future__ import annotations

import bisect
import io
from abc import abstractmethod
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _split_by_size_and_type
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import integrity
from .finite import refuse_nonfinite
from .items import CheckpointError
from .payload import PayloadFile, ZipTemplates

PAYLOAD_SUFFIX = ".distcp"
FILES_PER_RANK = 2  # payload files each rank writes at once, on a thread each (the best raw write's shape)


class _Writing:
    """A payload written and then fsynced on a thread of its own (both calls release the GIL, so
    the checksums and the inf/NaN scan of a written file run while the files are synced, and each
    file's fsync starts as soon as its own write ends). :meth:`written` waits for the write,
    :meth:`join` for the fsync, and closes the file; each re-raises the thread's error."""

    def __init__(self, payload: PayloadFile) -> None:
        self.payload, self._error = payload, None
        self._written = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paratron-checkpoint-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.payload.flush()
            self._written.set()
            os.fsync(self.payload.fd)
        except BaseException as e:  # noqa: BLE001 - re-raised on the saving thread
            self._error = e
        finally:
            self._written.set()

    def written(self) -> None:
        self._written.wait()
        if self._error is not None:
            raise self._error

    def join(self) -> None:
        self._thread.join()
        self.payload.close()
        if self._error is not None:
            raise self._error


class _SyncingFileSystem(FileSystem):
    """DCP's file system with every file it writes (``.metadata``) fsynced before it is closed
    (the payloads are written by :class:`ChecksummingWriter` itself)."""

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            yield stream
            if mode == "wb":
                stream.flush()
                os.fsync(stream.fileno())


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose payload files are checksummed as they are written and
    fsynced in the background of the checksums and the inf/NaN scan.

    Each rank's checksums (and its inf/NaN finding) reach the coordinator with DCP's own
    gathering of the write results (extra ``WriteResult`` entries under reserved keys, taken out
    again before ``.metadata`` is written), so no collective of ours is needed for them. With
    ``refuse_nonfinite_at``, the coordinator refuses, before ``.metadata`` is written, a save in
    which any rank's written tensors hold an inf or NaN: every rank's save then raises the same
    :class:`CheckpointError` (the caller removes the directory).

    Args:
        path: the checkpoint directory.
        other_sums: manifest entries of this rank's other files of the checkpoint (its
            ``rank_<r>.json``), to travel with its payloads' entries.
        refuse_nonfinite_at: the step being saved, to check every written tensor for an inf or
            NaN (:func:`paratron.checkpoint.finite.refuse_nonfinite`); None: no check.
        on_commit: ``fn(all_sums, bytes of the checkpoint's tensors or None)``, called on the
            coordinator at the end of :meth:`finish`, once ``.metadata`` is durable; DCP
            broadcasts its outcome to every rank with the save's own last collective.
        templates: the :class:`~paratron.checkpoint.payload.ZipTemplates` to write tensors with
            (a manager keeps one across its saves); None: a new one.

    Attributes:
        sums: after the save, ``{file name: manifest entry}`` of this rank's payloads and
            ``other_sums`` (:func:`paratron.checkpoint.integrity.block_entry`).
        all_sums: after the save, on the coordinator only: every rank's :attr:`sums` merged
            (None elsewhere).
    """

    SUMS_KEY = "paratron/checksums"
    NONFINITE_KEY = "paratron/nonfinite"

    def __init__(self, path: str | os.PathLike, other_sums: dict | None = None,
                 refuse_nonfinite_at: int | None = None, on_commit=None,
                 templates: ZipTemplates | None = None) -> None:
        # sync_files=False: .metadata is made durable by the file system below, payloads here.
        super().__init__(str(path), single_file_per_rank=True, sync_files=False, overwrite=True)
        self.sums: dict[str, list] = dict(other_sums or {})
        self.all_sums: dict[str, list] | None = None
        self.fs = _SyncingFileSystem()
        self._step = refuse_nonfinite_at
        self._on_commit = on_commit
        self._templates = templates if templates is not None else ZipTemplates()
        self._planner = None

    def write_data(self, plan, planner):
        """Write this rank's payload files ``<prefix><i>.distcp`` (DCP's names, its split of the
        items by size: :data:`FILES_PER_RANK` at most) as
        :class:`~paratron.checkpoint.payload.PayloadFile` describes, each written and then
        fsynced on a thread of its own (:class:`_Writing`); each file, once written, gets its
        block CRCs from the written buffers and the inf/NaN scan of its tensors (one pass) while
        the writes and fsyncs go on."""
        self._planner = planner
        buckets = _split_by_size_and_type(max(1, min(FILES_PER_RANK, len(plan.items))), plan.items)
        payloads, results = [], []
        try:
            for i, bucket in enumerate(buckets):
                name = f"{plan.storage_data.prefix}{i}{PAYLOAD_SUFFIX}"
                payloads.append(PayloadFile(Path(self.path) / name, name, self._templates))
                results += payloads[-1].add(bucket, planner)
        except BaseException:
            for p in payloads:
                p.close()
            raise
        writing = [_Writing(p) for p in payloads]
        bad = []
        try:  # each file scanned once written, while the files are written and synced
            for w in writing:
                w.written()
                crc, found = w.payload.scan(integrity.BLOCK, check_finite=self._step is not None)
                self.sums[w.payload.name] = crc.entry()
                bad += [found] if found is not None else []
        finally:
            errors = []
            for w in writing:
                try:
                    w.join()
                except BaseException as e:  # noqa: BLE001 - the first is re-raised below
                    errors.append(e)
            if errors:
                raise errors[0]
        done: Future = Future()
        done.set_result(results + [WriteResult(MetadataIndex(self.SUMS_KEY), 0, dict(self.sums)),
                                   WriteResult(MetadataIndex(self.NONFINITE_KEY), 0, min(bad) if bad else None)])
        return done

    def finish(self, metadata, results) -> None:
        self.all_sums = {}
        kept, nonfinite = [], []
        for per_rank in results:
            found = None
            for r in per_rank:
                if r.index.fqn == self.SUMS_KEY:
                    self.all_sums.update(r.storage_data)
                elif r.index.fqn == self.NONFINITE_KEY:
                    found = r.storage_data
            nonfinite.append(found)
            kept.append([r for r in per_rank if r.index.fqn not in (self.SUMS_KEY, self.NONFINITE_KEY)])
        if self._step is not None:
            refuse_nonfinite(nonfinite, self._step)
        super().finish(metadata, kept)
        if self._on_commit is not None:
            self._on_commit(self.all_sums, getattr(self._planner, "needed", None))


class BlockReader:
    """Reads byte ranges of one payload file, verifying each block read against its CRC.

    Args:
        path: the file (opened here; :meth:`close` closes it).
        entry: its manifest entry with block checksums (:func:`integrity.block_entry`).
        rank: the reading rank, named in errors.
        algorithm: the CRC the manifest's checksums were computed with
            (:func:`integrity.manifest_algorithm`).

    Attributes:
        failure: the error :meth:`read_into` raised, if any (``torch.load`` replaces an error
            raised inside a read of its file object by an unrelated ``AttributeError``; the caller
            re-raises this one).

    Raises (from the constructor):
        CheckpointError: the file is missing, or of another size than at save time.
    """

    def __init__(self, path: Path, entry: list, rank: int, algorithm: integrity.Algorithm) -> None:
        integrity.check_size(path, int(entry[1]), rank)
        self.algorithm = algorithm
        self.path, self.size, self.rank = path, int(entry[1]), rank
        self.block, self.crcs = integrity.entry_blocks(entry, algorithm)
        self.failure: CheckpointError | None = None
        self._fd = os.open(path, os.O_RDONLY)
        self._cache: dict[int, memoryview] = {}  # verified blocks read for partial ranges, by last use

    def close(self) -> None:
        os.close(self._fd)

    def read_into(self, start: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes from ``start``, every block they lie in verified.

        Raises:
            CheckpointError: a block's CRC differs from the one at save time (names the file,
                the byte range and the rank).
        """
        pos, end = start, start + len(out)
        if end > self.size:
            self._fail(f"a read of bytes {start:,}-{end:,} goes past its end ({self.size:,} bytes; read by rank "
                       f"{self.rank}); the checkpoint's metadata does not match it")
        while pos < end:
            k = pos // self.block
            lo, hi = k * self.block, min((k + 1) * self.block, self.size)
            stop = min(end, hi)
            if pos == lo and stop == hi and k not in self._cache:  # a whole block: straight into out
                self._read_verified(k, out[pos - start:hi - start])
            else:
                out[pos - start:stop - start] = self._cached(k)[pos - lo:stop - lo]
            pos = stop

    def _cached(self, k: int) -> memoryview:
        """Block ``k``, read and verified once while it stays among the last few used (the
        blocks at the edges of neighbouring saved chunks, which their headers share)."""
        view = self._cache.pop(k, None)
        if view is None:
            lo = k * self.block
            view = memoryview(bytearray(min(self.block, self.size - lo)))
            self._read_verified(k, view)
            if len(self._cache) >= 3:
                self._cache.pop(next(iter(self._cache)))  # the least recently used
        self._cache[k] = view  # (re)inserted last: most recently used
        return view

    def _read_verified(self, k: int, dest: memoryview) -> None:
        """Read block ``k`` into ``dest`` (its length), ``integrity.READ_SCAN`` bytes at a time,
        each piece checksummed just after it is read, while in the CPU's cache."""
        lo, crc = k * self.block, self.algorithm.start()
        for a in range(0, len(dest), integrity.READ_SCAN):
            piece = dest[a:a + integrity.READ_SCAN]
            _preadv_all(self._fd, [piece], lo + a, lambda end: self._fail(
                f"ended at byte {end:,} while reading (read by rank {self.rank}); the file is truncated"))
            crc = self.algorithm.extend(crc, piece)
        if k >= len(self.crcs) or self.algorithm.value(crc) != self.crcs[k]:
            self._fail(f"checksum mismatch in bytes {lo:,}-{lo + len(dest):,} (read by rank {self.rank}); the file "
                       "is corrupt")

    def _fail(self, what: str) -> None:
        self.failure = CheckpointError(f"{self.path}: {what}")
        raise self.failure


class _Window(io.RawIOBase):
    """A read-only, seekable window ``[offset, offset + length)`` of a file; subclasses say how
    its bytes are read (:meth:`_fill`)."""

    def __init__(self, offset: int, length: int) -> None:
        super().__init__()
        self._offset, self._length, self._pos = offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._length - self._pos))
        if n:
            n = self._fill(self._offset + self._pos, memoryview(b).cast("B")[:n])
            self._pos += n
        return n

    @abstractmethod
    def _fill(self, at: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes of the file from byte ``at`` into ``out``; returns the count."""


class VerifiedRange(_Window):
    """A window of a file read through a :class:`BlockReader`, every block verified (what DCP's
    ``torch.load`` of one saved chunk reads)."""

    def __init__(self, reader: BlockReader, offset: int, length: int) -> None:
        super().__init__(offset, length)
        self._reader = reader

    def _fill(self, at: int, out: memoryview) -> int:
        self._reader.read_into(at, out)
        return len(out)


# ---- the direct, streamed load -------------------------------------------------------------
IOV_MAX = 1024  # the most buffers one preadv takes (Linux)


class _RawRange(_Window):
    """An unverified window of a file descriptor, for parsing a saved chunk's zip directory and
    pickle (the few hundred bytes that say where its tensor data lies); the bytes themselves are
    verified by the streamed read that follows."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__(offset, length)
        self._fd = fd

    def _fill(self, at: int, out: memoryview) -> int:
        return os.preadv(self._fd, [out], at)


def tensor_data_range(fd: int, offset: int, length: int) -> tuple[int, torch.Tensor]:
    """Where the tensor of the saved chunk ``[offset, offset + length)`` of a payload file keeps
    its data: ``(file offset of its storage's first byte, the tensor on the meta device)``.

    ``torch.load`` onto the meta device reads only the chunk's zip directory and pickle (with
    ``weights_only``) and records each storage's offset in the zip (``_checkpoint_offset``), so
    the data can then be read straight into its destination instead of into a fresh tensor.

    Raises:
        ValueError: the data does not lie inside the chunk (its directory is corrupt).
        Exception: whatever ``torch.load`` raises on a malformed chunk.
    """
    meta = torch.load(_RawRange(fd, offset, length), map_location="meta", weights_only=True)
    storage = meta.untyped_storage()
    start = int(storage._checkpoint_offset)
    if not 0 <= start <= start + storage.nbytes() <= length:
        raise ValueError(f"storage at {start} of {storage.nbytes()} bytes lies outside a chunk of {length}")
    return offset + start, meta


class ChunkLayouts:
    """Where the tensor data of saved chunks lies, parsed with :func:`tensor_data_range` once per
    distinct chunk: a chunk whose bytes around its data (zip headers, pickle, zip directory) equal
    those of a chunk already parsed, and whose length is the same, is the same tensor layout at the
    same place (``torch.save`` of tensors of one dtype, shape and strides writes the same bytes
    there), so a model's many same-shaped chunks cost one parse each shape, not one each."""

    KEEP = 4  # layouts remembered per chunk length

    def __init__(self) -> None:
        self._known: dict[int, list[tuple[bytes, bytes, int, torch.Tensor]]] = {}

    def find(self, fd: int, offset: int, length: int) -> tuple[int, torch.Tensor]:
        """As :func:`tensor_data_range`."""
        for head, tail, start, meta in self._known.get(length, ()):
            if os.pread(fd, len(head), offset) == head and os.pread(fd, len(tail), offset + length - len(tail)) == tail:
                return offset + start, meta
        at, meta = tensor_data_range(fd, offset, length)
        start = at - offset
        end = start + meta.untyped_storage().nbytes()
        known = self._known.setdefault(length, [])
        if len(known) < self.KEEP:
            known.append((os.pread(fd, start, offset), os.pread(fd, length - end, offset + end), start, meta))
        return at, meta


def direct_destination(layouts: ChunkLayouts, fd: int, sinfo, req, planner) -> tuple[int, memoryview, torch.Tensor, object] | None:
    """``(file offset, destination bytes, destination tensor, req)`` when DCP's read item ``req``
    of the saved chunk ``sinfo`` (its ``_StorageInfo``) can be read straight into its destination:
    the wanted sub-box is contiguous in the file and the destination a contiguous CPU tensor of
    the same dtype and shape. None otherwise, and for a chunk whose directory cannot be parsed
    (DCP's ``torch.load`` then reads it through a :class:`VerifiedRange`, which reports a corrupt
    block). Assumes little-endian payloads, as ``torch.save`` writes them on little-endian hosts."""
    try:
        start, meta = layouts.find(fd, sinfo.offset, sinfo.length)
    except Exception:  # noqa: BLE001 - the verified path reads this chunk and names what is wrong
        return None
    src = narrow_tensor_by_index(meta, req.storage_offsets, req.lengths)
    tensor = planner.resolve_tensor(req).detach()
    if (sys.byteorder != "little" or tensor.device.type != "cpu" or tensor.dtype != src.dtype
            or tensor.shape != src.shape or tensor.numel() == 0 or not src.is_contiguous()
            or not tensor.is_contiguous()):
        return None
    dest = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
    return start + src.storage_offset() * src.element_size(), dest, tensor, req


def _preadv_all(fd: int, buffers: list[memoryview], at: int, fail) -> None:
    """Fill ``buffers`` in order from the file's bytes at ``at`` (short reads resumed, at most
    ``IOV_MAX`` buffers a call); ``fail(offset)`` when the file ends first."""
    i, skip = 0, 0
    while i < len(buffers):
        batch = [buffers[i][skip:]] + buffers[i + 1:i + IOV_MAX]
        n = os.preadv(fd, batch, at)
        if n == 0:
            fail(at)
        at += n
        while i < len(buffers) and n >= len(buffers[i]) - skip:
            n -= len(buffers[i]) - skip
            i, skip = i + 1, 0
        skip += n


def _segments(pieces: list[memoryview], size: int):
    """``pieces`` in order, cut into runs of ``size`` bytes (the last shorter): lists of slices."""
    segment, room = [], size
    for p in pieces:
        while len(p):
            take = p[:room]
            segment.append(take)
            p, room = p[len(take):], room - len(take)
            if room == 0:
                yield segment
                segment, room = [], size
    if segment:
        yield segment


class StreamedFile:
    """One payload file read for a load: every block overlapping the wanted byte ranges is read
    once, its bytes scattered straight into their destinations (the tensors being loaded) with
    one ``preadv`` and the bytes nobody wants into a scratch buffer, then verified against its
    save-time CRC while still in cache (:meth:`read_blocks`). No intermediate tensor, no copy.
    The bytes land before their block is verified, so a load that fails verification leaves its
    destinations partly overwritten: it raises, and nothing goes on with those tensors (a failed
    load ends the run on every rank, :meth:`CheckpointManager.load_everywhere`).

    Args:
        path, entry, rank, algorithm: as :class:`BlockReader`.

    Raises (from the constructor):
        CheckpointError: the file is missing, or of another size than at save time.
    """

    def __init__(self, path: Path, entry: list, rank: int, algorithm: integrity.Algorithm) -> None:
        integrity.check_size(path, int(entry[1]), rank)
        self.path, self.size, self.rank, self.algorithm = path, int(entry[1]), rank, algorithm
        self.block, self.crcs = integrity.entry_blocks(entry, algorithm)
        self.fd = os.open(path, os.O_RDONLY)
        self._targets: list[tuple[int, memoryview]] = []  # (file offset, destination bytes), sorted
        self._reads: list[tuple] = []  # (DCP read item, its destination tensor), to commit
        self._blocks: set[int] = set()

    def close(self) -> None:
        os.close(self.fd)

    def want(self, lo: int, hi: int) -> None:
        """Read and verify bytes ``[lo, hi)`` (every block they touch)."""
        if hi > self.size:
            self._fail(f"a read of bytes {lo:,}-{hi:,} goes past its end ({self.size:,} bytes; read by rank "
                       f"{self.rank}); the checkpoint's metadata does not match it")
        self._blocks.update(range(lo // self.block, (hi - 1) // self.block + 1) if hi > lo else ())

    def target(self, at: int, dest: memoryview, tensor: torch.Tensor, req) -> bool:
        """Deliver the file's bytes ``[at, at + len(dest))`` into ``dest`` (the bytes of
        ``tensor``, the destination of DCP's read item ``req``); False (nothing planned) where
        they overlap bytes already planned for another destination."""
        k = bisect.bisect_right([o for o, _ in self._targets], at)
        before = k > 0 and self._targets[k - 1][0] + len(self._targets[k - 1][1]) > at
        after = k < len(self._targets) and self._targets[k][0] < at + len(dest)
        if before or after:
            return False
        self._targets.insert(k, (at, dest))
        self._reads.append((req, tensor))
        self.want(at, at + len(dest))
        return True

    def commit(self, planner) -> None:
        """Tell DCP's planner that every planned destination is filled (after :func:`read_streamed`)."""
        for req, tensor in self._reads:
            planner.commit_tensor(req, tensor)

    def runs(self, per_task: int) -> list[list[int]]:
        """The wanted blocks in order, in runs of at most ``per_task`` (one thread's work each)."""
        blocks = sorted(self._blocks)
        return [blocks[i:i + per_task] for i in range(0, len(blocks), per_task)]

    def read_blocks(self, blocks: list[int]) -> None:
        """Read and verify ``blocks`` (called from a reader thread; they share nothing with other
        calls but the file descriptor, which ``preadv`` does not move).

        Raises:
            CheckpointError: a block's CRC differs from the one at save time, or the file ends early.
        """
        starts = [o for o, _ in self._targets]
        for k in blocks:
            lo, hi = k * self.block, min((k + 1) * self.block, self.size)
            crc, at = self.algorithm.start(), lo
            for segment in _segments(self._pieces(lo, hi, starts), integrity.READ_SCAN):
                _preadv_all(self.fd, segment, at, lambda end: self._fail(
                    f"ended at byte {end:,} while reading (read by rank {self.rank}); the file is truncated"))
                for p in segment:  # checksummed just after it is read, while in the CPU's cache
                    crc = self.algorithm.extend(crc, p)
                    at += len(p)
            if k >= len(self.crcs) or self.algorithm.value(crc) != self.crcs[k]:
                self._fail(f"checksum mismatch in bytes {lo:,}-{hi:,} (read by rank {self.rank}); the file "
                           "is corrupt")

    def _pieces(self, lo: int, hi: int, starts: list[int]) -> list[memoryview]:
        """The buffers, in file order, that bytes ``[lo, hi)`` are read into: slices of the
        destinations, and for the bytes nobody wants (zip headers, chunks of other ranks) one
        scratch buffer of just their size."""
        pieces: list = []
        gaps, cursor = [], lo
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(self._targets) and self._targets[i][0] < hi:
            at, dest = self._targets[i]
            a, b = max(lo, at), min(hi, at + len(dest))
            if b > a:
                if a > cursor:
                    gaps.append(len(pieces))
                    pieces.append(a - cursor)
                pieces.append(dest[a - at:b - at])
                cursor = b
            i += 1
        if cursor < hi:
            gaps.append(len(pieces))
            pieces.append(hi - cursor)
        scratch, used = memoryview(bytearray(sum(pieces[g] for g in gaps))), 0
        for g in gaps:
            pieces[g], used = scratch[used:used + pieces[g]], used + pieces[g]
        return pieces

    def _fail(self, what: str) -> None:
        raise CheckpointError(f"{self.path}: {what}")


def read_streamed(files: list[StreamedFile], threads: int, per_task: int = 4) -> None:
    """Read every planned block of ``files`` on ``threads`` threads (``preadv`` releases the GIL,
    and so does xxhash's XXH3-64; google-crc32c, for older checkpoints, holds it, so there one
    thread's reads overlap another's checksums).

    Raises:
        CheckpointError: the first failure, in file and block order.
    """
    tasks = [(f, run) for f in files for run in f.runs(per_task)]
    if threads <= 1 or len(tasks) <= 1:
        for f, run in tasks:
            f.read_blocks(run)
        return
    with ThreadPoolExecutor(min(threads, len(tasks))) as pool:
        for done in [pool.submit(f.read_blocks, run) for f, run in tasks]:
            done.result()
