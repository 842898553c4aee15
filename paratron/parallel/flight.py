"""The flight recorder: a ring buffer of this rank's last collectives and p2p ops.

The comm ledger (:mod:`paratron.parallel.comm`) feeds it when ``ledger.flight`` is set: every
:class:`~paratron.parallel.comm.Group` call opens one :class:`FlightEntry` (op, group, shapes,
dtype, wall-clock start) and closes it when the call returns (synchronous ops) or when its work
handle is seen completed (asynchronous ops and p2p: :meth:`FlightRecorder.poll`, run by the
watchdog thread, and :meth:`FlightRecorder.close_all` at the end of a step, when every op of
the step has been waited for). ``seq`` numbers the ops of one process group (its ranks tuple)
on this rank, from 1: ranks that issue the same program give the same op the same number, so
comparing the numbers of several ranks' dumps shows who never entered an op (the hang
diagnosis, :mod:`paratron.launch.hang`).

Each collective (p2p ops left out: a send pairs with a recv) also gets ``cseq``, its number
among the group's collectives, and a *signature* (:func:`signature`: op, group, reduce op, dtype
and element count) folded into a running CRC per group (:meth:`FlightRecorder.fingerprints`).
Members of a group that issued the same collectives hold the same CRC, so comparing them once a
step (:mod:`paratron.parallel.collcheck`) finds a rank that ran another op at the same number,
which gloo and NCCL would pair with the wrong one without a word.

With a ``black_box`` path the collectives are also written, one fixed-size record each, to a
memory-mapped file (:class:`BlackBox`): it outlives a rank that dies without running any Python
(gloo aborts the process on a byte-count mismatch; SIGKILL), so the diagnosis can still tell what
that rank ran.

The same idea as PyTorch's NCCL Flight Recorder, kept in Python so that it works on every
backend (gloo included) and costs one small object per op.
"""

from __future__ import annotations

import mmap
import struct
import time
import zlib
from pathlib import Path
from typing import Any

import torch


P2P_OPS = ("send", "recv")


def signature(op: str, group: str, reduce: str | None, dtype: str | None, shape: list | None,
              numel: int | None = None) -> str:
    """What the members of a group must agree on for one collective, as text: op, group, reduce
    op, dtype and element count (``all_to_all``: the trailing dims only, since uneven splits make
    the row count differ from rank to rank). E.g. ``"all_reduce@tp SUM float32 x4096"``."""
    if shape is None:
        size = "-"
    elif op == "all_to_all":
        size = "[*," + ",".join(map(str, shape[1:])) + "]"
    else:
        size = f"x{numel if numel is not None else _prod(shape)}"
    return f"{op}@{group} {reduce or '-'} {dtype or '-'} {size}"


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_KEY_MAX = 120  # longest ranks text a black-box record holds
BOX_RECORD = 256
"""Bytes of one black-box record."""
_BOX_HEAD = struct.Struct("<II")  # CRC of the payload, payload length
_BOX_FIXED = struct.Struct("<qqd")  # cseq, step, start


def group_key(ranks) -> str:
    """A group's key across ranks' records: its ranks joined by commas, or for a group too long
    to store in a black-box record, ``#`` and the CRC of that text."""
    text = ",".join(map(str, ranks))
    return text if len(text) <= _KEY_MAX else f"#{zlib.crc32(text.encode()):08x}"


class BlackBox:
    """The flight recorder's collectives in a memory-mapped file, ``capacity`` records in a ring.

    A record is ``[crc32, length, cseq, step, start, "key|group|signature"]``; the page cache
    keeps what was written when the process dies, whatever kills it. A record torn by a death in
    mid-write fails its CRC and is skipped by :func:`read_black_box`.
    """

    def __init__(self, path: Path | str, capacity: int) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w+b") as f:
            f.truncate(capacity * BOX_RECORD)
            self._mm = mmap.mmap(f.fileno(), capacity * BOX_RECORD)
        self.capacity, self._n = capacity, 0
        self._keys: dict[tuple[int, ...], str] = {}  # group_key per ranks tuple (long for big groups)

    def write(self, e: "FlightEntry") -> None:
        key = self._keys.get(e.ranks)
        if key is None:
            key = self._keys[e.ranks] = group_key(e.ranks)
        text = f"{key}|{e.group}|{e.sig}".encode()
        payload = _BOX_FIXED.pack(e.cseq, e.step, e.start) + text[:BOX_RECORD - _BOX_HEAD.size - _BOX_FIXED.size]
        off = (self._n % self.capacity) * BOX_RECORD
        self._mm[off:off + _BOX_HEAD.size + len(payload)] = _BOX_HEAD.pack(zlib.crc32(payload), len(payload)) + payload
        self._n += 1

    def close(self) -> None:
        self._mm.close()


def read_black_box(path: Path | str) -> list[dict]:
    """The intact records of a :class:`BlackBox` file as entry dicts (``cseq``, ``step``,
    ``start``, ``group``, ``sig``, ``key``; ``ranks`` when the key holds them), oldest first."""
    data, out = Path(path).read_bytes(), []
    for off in range(0, len(data) - BOX_RECORD + 1, BOX_RECORD):
        crc, n = _BOX_HEAD.unpack_from(data, off)
        payload = data[off + _BOX_HEAD.size:off + _BOX_HEAD.size + n]
        if n < _BOX_FIXED.size or len(payload) != n or zlib.crc32(payload) != crc:
            continue
        cseq, step, start = _BOX_FIXED.unpack_from(payload)
        parts = payload[_BOX_FIXED.size:].decode(errors="replace").split("|", 2)
        if len(parts) != 3:
            continue
        key, group, sig = parts
        ranks = None if key.startswith("#") else [int(r) for r in key.split(",")]
        out.append({"cseq": cseq, "step": step, "start": start, "end": None, "group": group,
                    "sig": sig, "key": key, "ranks": ranks, "op": sig.split("@", 1)[0]})
    return sorted(out, key=lambda e: e["start"])


def reduce_name(op: Any) -> str | None:
    """``"SUM"`` for ``dist.ReduceOp.SUM`` (None for None)."""
    return None if op is None else getattr(op, "name", str(op))


class FlightEntry:
    """One op. ``start``/``end`` are ``time.time()`` seconds (``end`` is None while pending);
    ``cseq`` and ``sig`` are None for p2p ops."""

    __slots__ = ("seq", "op", "group", "ranks", "shape", "dtype", "step", "start", "end", "work",
                 "reduce", "cseq", "sig")

    def __init__(self, seq, op, group, ranks, shape, dtype, step, start, reduce=None, cseq=None, sig=None):
        self.seq, self.op, self.group, self.ranks = seq, op, group, ranks
        self.shape, self.dtype, self.step, self.start = shape, dtype, step, start
        self.reduce, self.cseq, self.sig = reduce, cseq, sig
        self.end: float | None = None
        self.work: Any = None

    def as_dict(self) -> dict:
        return {"seq": self.seq, "op": self.op, "group": self.group, "ranks": list(self.ranks),
                "shape": self.shape, "dtype": self.dtype, "step": self.step,
                "start": self.start, "end": self.end, "reduce": self.reduce, "cseq": self.cseq,
                "sig": self.sig}


class FlightRecorder:
    """Ring buffer of the last ``capacity`` ops of this rank, plus per-group op counts.

    ``step`` is set by the training loop (the step being run, from 1) and stamped on each entry.
    Writes happen on the training thread; :meth:`poll` and :meth:`snapshot` may run on another
    thread (list slot writes are atomic under the GIL, and a slot only ever holds a whole entry).

    ``exhaustive`` (``parallel.check_collectives``): every collective first exchanges its
    signature with the group's other members (:func:`paratron.parallel.collcheck.exchange`,
    called by the :class:`~paratron.parallel.comm.Group` methods), so that a mismatch is
    refused before the op runs.
    """

    def __init__(self, capacity: int = 256, exhaustive: bool = False,
                 black_box: Path | str | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.exhaustive = exhaustive
        self.box = BlackBox(black_box, capacity) if black_box is not None else None
        self._slots: list[FlightEntry | None] = [None] * capacity
        self._next = 0
        self.counts: dict[tuple[int, ...], int] = {}
        self.ccounts: dict[tuple[int, ...], int] = {}  # collectives only (cseq)
        self._crc: dict[tuple[int, ...], int] = {}
        self.slots: dict[tuple[int, ...], int] | None = None  # the stop agreement's, on first use
        self.step = 0

    # Never traced by torch.compile (its callers sit inside compiled layers; why eager and not
    # skipped: paratron.parallel.comm, the flight recorder hook): dynamo would guard on the
    # counters, which change with every op (a recompile each time), and cannot call the clock or
    # the CRC.
    @torch.compiler.disable
    def begin(self, op: str, group: str, ranks: tuple[int, ...], t: torch.Tensor | None,
              reduce: Any = None) -> FlightEntry:
        """Open an entry for ``op`` on the group with global ``ranks`` (payload ``t``, reduce op
        ``reduce``); a collective's signature is folded into the group's fingerprint."""
        seq = self.counts.get(ranks, 0) + 1
        self.counts[ranks] = seq
        shape, dtype = (list(t.shape), str(t.dtype).replace("torch.", "")) if t is not None else (None, None)
        red = reduce_name(reduce)
        cseq = sig = None
        if op not in P2P_OPS:
            cseq = self.ccounts.get(ranks, 0) + 1
            self.ccounts[ranks] = cseq
            sig = signature(op, group, red, dtype, shape, t.numel() if t is not None else None)
            self._crc[ranks] = zlib.crc32(sig.encode(), self._crc.get(ranks, 0))
        e = FlightEntry(seq, op, group, ranks, shape, dtype, self.step, time.time(), red, cseq, sig)
        if self.box is not None and cseq is not None:
            self.box.write(e)
        self._slots[self._next % self.capacity] = e
        self._next += 1
        return e

    def restart_counts(self) -> None:
        """Count every group from zero again: the process groups were re-made with another
        membership (:mod:`paratron.elastic.regrid`), and a process that joined counts from there."""
        self.counts, self.ccounts, self._crc, self.slots = {}, {}, {}, None

    @staticmethod
    @torch.compiler.disable  # as begin: the end time is the clock's when the op has run
    def finish(entry: FlightEntry, work: Any = None) -> None:
        """Close a synchronous op now, or attach the work handle of an asynchronous one."""
        if work is None:
            entry.end = time.time()
        else:
            entry.work = work

    def entries(self) -> list[FlightEntry]:
        """The buffered entries, oldest first."""
        n, cap = self._next, self.capacity
        slots = list(self._slots)
        order = slots[n % cap:] + slots[:n % cap] if n > cap else slots[:n]
        return [e for e in order if e is not None]

    def poll(self) -> None:
        """Close the asynchronous entries whose work has completed (end = the time seen)."""
        now = time.time()
        for e in self.entries():
            w = e.work
            if e.end is None and w is not None and w.is_completed():
                e.end, e.work = now, None

    def close_all(self) -> None:
        """Close every open entry: the caller (the end of a step) knows that every op it issued
        has been waited for."""
        now = time.time()
        for e in self.entries():
            if e.end is None:
                e.end, e.work = now, None

    def pending(self) -> list[FlightEntry]:
        """Open entries, oldest first, leaving out p2p ops whose work was never attached (built
        by :meth:`Group.p2p_op` but posted by a direct ``dist.batch_isend_irecv``: their
        completion cannot be seen)."""
        return [e for e in self.entries() if e.end is None
                and (e.work is not None or e.op not in ("send", "recv"))]

    def fingerprints(self) -> dict[tuple[int, ...], tuple[int, int]]:
        """Per group (its ranks): ``(collectives entered, running CRC of their signatures)``."""
        return {k: (n, self._crc.get(k, 0)) for k, n in self.ccounts.items()}

    def snapshot(self) -> dict:
        """JSON-ready state: every buffered entry and the op count of every group."""
        return {"step": self.step,
                "counts": {",".join(map(str, k)): v for k, v in self.counts.items()},
                "entries": [e.as_dict() for e in self.entries()]}
