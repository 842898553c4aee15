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

The same idea as PyTorch's NCCL Flight Recorder, kept in Python so that it works on every
backend (gloo included) and costs one small object per op.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class FlightEntry:
    """One op. ``start``/``end`` are ``time.time()`` seconds (``end`` is None while pending)."""

    __slots__ = ("seq", "op", "group", "ranks", "shape", "dtype", "step", "start", "end", "work")

    def __init__(self, seq, op, group, ranks, shape, dtype, step, start):
        self.seq, self.op, self.group, self.ranks = seq, op, group, ranks
        self.shape, self.dtype, self.step, self.start = shape, dtype, step, start
        self.end: float | None = None
        self.work: Any = None

    def as_dict(self) -> dict:
        return {"seq": self.seq, "op": self.op, "group": self.group, "ranks": list(self.ranks),
                "shape": self.shape, "dtype": self.dtype, "step": self.step,
                "start": self.start, "end": self.end}


class FlightRecorder:
    """Ring buffer of the last ``capacity`` ops of this rank, plus per-group op counts.

    ``step`` is set by the training loop (the step being run, from 1) and stamped on each entry.
    Writes happen on the training thread; :meth:`poll` and :meth:`snapshot` may run on another
    thread (list slot writes are atomic under the GIL, and a slot only ever holds a whole entry).
    """

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity={capacity} must be >= 1")
        self.capacity = capacity
        self._slots: list[FlightEntry | None] = [None] * capacity
        self._next = 0
        self.counts: dict[tuple[int, ...], int] = {}
        self.step = 0

    def begin(self, op: str, group: str, ranks: tuple[int, ...], t: torch.Tensor | None) -> FlightEntry:
        """Open an entry for ``op`` on the group with global ``ranks`` (payload ``t``)."""
        seq = self.counts.get(ranks, 0) + 1
        self.counts[ranks] = seq
        shape, dtype = (list(t.shape), str(t.dtype).replace("torch.", "")) if t is not None else (None, None)
        e = FlightEntry(seq, op, group, ranks, shape, dtype, self.step, time.time())
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

    def snapshot(self) -> dict:
        """JSON-ready state: every buffered entry and the op count of every group."""
        return {"step": self.step,
                "counts": {",".join(map(str, k)): v for k, v in self.counts.items()},
                "entries": [e.as_dict() for e in self.entries()]}
