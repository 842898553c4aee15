"""The flight recorder: a ring buffer of this rank's last collectives and p2p ops.

The comm ledger (:mod:`paratron.parallel.comm`) feeds it when ``ledger.flight`` is set: every
:class:`~paratron.parallel.comm.Group` call opens one :class:`FlightEntry` (op, group, shapes,
dtype, wall-clock start) and closes it when the call returns (synchronous ops) or when its work
handle is seen completed (asynchronous ops and p2p: :meth:`FlightRecorder.poll`, run by the
watchdog thread, and :meth:`FlightRecorder.close_all` at the end of a step, when every op of
the step has been waited for). ``seq`` numbers the ops of one process group (its ranks tuple)
on this rank, from 1: ranks that issue the same program give the same op the same number, so
comparing the numbers of several ranks' dumps shows who never entered an op (the hang
diagnosis, :mod:`paratron.training.hang`).

Each collective (p2p ops left out: a send pairs with a recv) also gets ``cseq``, its number
among the group's collectives, and a *signature* (:func:`signature`: op, group, reduce op, dtype
and element count) folded into a running CRC per group (:meth:`FlightRecorder.fingerprints`).
Members of a group that issued the same collectives hold the same CRC, so comparing them once a
step (:mod:`paratron.parallel.collcheck`) finds a rank that ran another op at the same number,
which gloo and NCCL would pair with the wrong one without a word.

The same idea as PyTorch's NCCL Flight Recorder, kept in Python so that it works on every
backend (gloo included) and costs one small object per op.
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import torch


P2P_OPS = ("send", "recv")


def signature(op: str, group: str, reduce: str | None, dtype: str | None, shape: list | None) -> str:
    """What the members of a group must agree on for one collective, as text: op, group, reduce
    op, dtype and element count (``all_to_all``: the trailing dims only, since uneven splits make
    the row count differ from rank to rank). E.g. ``"all_reduce@tp SUM float32 x4096"``."""
    if shape is None:
        size = "-"
    elif op == "all_to_all":
        size = "[*," + ",".join(map(str, shape[1:])) + "]"
    else:
        n = 1
        for d in shape:
            n *= d
        size = f"x{n}"
    return f"{op}@{group} {reduce or '-'} {dtype or '-'} {size}"


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

    def __init__(self, capacity: int = 256, exhaustive: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.exhaustive = exhaustive
        self._slots: list[FlightEntry | None] = [None] * capacity
        self._next = 0
        self.counts: dict[tuple[int, ...], int] = {}
        self.ccounts: dict[tuple[int, ...], int] = {}  # collectives only (cseq)
        self._crc: dict[tuple[int, ...], int] = {}
        self.step = 0

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
            sig = signature(op, group, red, dtype, shape)
            self._crc[ranks] = zlib.crc32(sig.encode(), self._crc.get(ranks, 0))
        e = FlightEntry(seq, op, group, ranks, shape, dtype, self.step, time.time(), red, cseq, sig)
        self._slots[self._next % self.capacity] = e
        self._next += 1
        return e

    @staticmethod
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
