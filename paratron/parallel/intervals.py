"""Interval recorder: when communication was in flight and when the compute it should hide ran.

Code that overlaps communication with compute (the chunked MoE dispatcher, a pipeline runtime that
overlaps microbatches) records here, so that a test can check the overlap structurally and a
benchmark can measure how much of the communication was hidden. The recorder is reached through
the comm ledger (``ctx.ledger.intervals``, None by default, like ``ledger.flight``): one attribute
check when off, and no argument to thread through the model.

Each :class:`Interval` carries ``time.perf_counter()`` seconds:

* compute: ``start`` / ``end`` around the code (:meth:`IntervalRecorder.compute`, or
  :meth:`IntervalRecorder.open` / :meth:`IntervalRecorder.close` when autograd runs the code);
* communication: ``start`` when issued, ``waited`` when the program's wait returned, and ``end``
  the completion: ``min(waited, completion stamp)``. The completion stamp is taken by a callback on
  the work's future (``Work.get_future().then``), run by the backend's thread as soon as the work
  completes. It is the earliest moment Python can see the completion without a polling thread; a
  poller on a 2-core shared machine would take CPU from the very compute being measured, and
  ``is_completed()`` checked at ``wait()`` only bounds the completion by the wait. The stamp is
  late by the callback's wait for the GIL (short: the compute thread releases it inside torch
  ops), so ``end`` is at or just after the true completion; compute running in that delay is
  counted as hidden, so :func:`hidden_fraction` can over-count by at most that delay per op.

``[start, waited]`` is the window in which the program *left* the op outstanding; it depends only
on the program's order (launch, compute, wait), not on timing, so tests check overlap with it
(:func:`overlaps`). ``[start, end]`` is the measured flight, used for the hidden fraction.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class Interval:
    """One recorded span. ``kind`` names what ran (e.g. ``"dispatch"``, ``"experts"``);
    ``scope`` is what the recorder's owner set when it started (e.g. ``(microbatch, stage)``);
    ``chunk`` the token chunk (chunked dispatch) or None."""

    kind: str
    comm: bool
    start: float
    end: float | None = None
    waited: float | None = None
    chunk: int | None = None
    scope: tuple = field(default_factory=tuple)

    def _completed(self, when: float) -> None:
        if self.end is None or when < self.end:
            self.end = when


class IntervalRecorder:
    """Collects :class:`Interval` s in issue order (``intervals``); ``scope`` is stamped on each
    new one (the pipeline runtime sets it to the running action's ``(microbatch, stage)``)."""

    def __init__(self) -> None:
        self.intervals: list[Interval] = []
        self.scope: tuple = ()

    def open(self, kind: str, *, comm: bool = False, chunk: int | None = None) -> Interval:
        """Start an interval now; close it with :meth:`close` (compute) or :meth:`waited` (comm)."""
        iv = Interval(kind, comm, time.perf_counter(), chunk=chunk, scope=self.scope)
        self.intervals.append(iv)
        return iv

    @staticmethod
    def close(iv: Interval) -> None:
        """End a compute interval (or a synchronous comm) now."""
        now = time.perf_counter()
        iv.end = now
        if iv.comm:
            iv.waited = now

    def issued(self, kind: str, work, *, chunk: int | None = None) -> Interval:
        """An asynchronous op was just launched with handle ``work`` (None: already complete,
        e.g. a size-1 group). Its completion is stamped from the work's future when the backend
        offers one; :meth:`waited` closes it in any case."""
        iv = self.open(kind, comm=True, chunk=chunk)
        if work is None:
            self.close(iv)
            return iv
        get_future = getattr(work, "get_future", None)
        if get_future is not None:
            try:
                get_future().then(lambda _fut: iv._completed(time.perf_counter()))
            except RuntimeError:  # a backend without futures for this op: the wait bounds it
                pass
        return iv

    @staticmethod
    def waited(iv: Interval) -> None:
        """The program's wait for the op of ``iv`` has just returned."""
        now = time.perf_counter()
        iv.waited = now
        iv._completed(now)

    @contextmanager
    def compute(self, kind: str, *, chunk: int | None = None):
        """Record the ``with`` body as a compute interval."""
        iv = self.open(kind, chunk=chunk)
        try:
            yield iv
        finally:
            self.close(iv)

    def take(self) -> list[Interval]:
        """The intervals recorded so far (closed or not), and forget them."""
        out, self.intervals = self.intervals, []
        return out


@contextmanager
def recording(ledger):
    """Install a fresh :class:`IntervalRecorder` as ``ledger.intervals`` inside the block (the
    previous one is restored after); yields it."""
    prev, rec = ledger.intervals, IntervalRecorder()
    ledger.intervals = rec
    try:
        yield rec
    finally:
        ledger.intervals = prev


def overlaps(intervals: list[Interval]) -> list[tuple[Interval, Interval]]:
    """The (comm, compute) pairs where the compute ran entirely while the comm was outstanding:
    ``comm.start <= compute.start`` and ``compute.end <= comm.waited``. Structural (program
    order), so deterministic; a dispatcher that waits for each op before computing has none."""
    comms = [c for c in intervals if c.comm and c.waited is not None]
    work = [w for w in intervals if not w.comm and w.end is not None]
    return [(c, w) for c in comms for w in work if c.start <= w.start and w.end <= c.waited]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def hidden_fraction(intervals: list[Interval], comm_kinds=None) -> tuple[float, float]:
    """``(hidden seconds, comm seconds)``: the communication time (flights ``[start, end]``,
    their union, so two ops in flight at once count once) and the part of it during which
    compute ran. Hidden / total is the overlap ratio FarSkip-Collective reports (EP
    communication hidden behind compute). ``comm_kinds``: only these comm kinds (None: all).

    Raises:
        ValueError: a comm interval was never completed.
    """
    comms = [c for c in intervals if c.comm and (comm_kinds is None or c.kind in comm_kinds)]
    if any(c.end is None for c in comms):
        raise ValueError("hidden_fraction: a communication interval was never waited for")
    flight = _union([(c.start, c.end) for c in comms])
    busy = _union([(w.start, w.end) for w in intervals if not w.comm and w.end is not None])
    total = sum(b - a for a, b in flight)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in flight for c, d in busy)
    return hidden, total


class _MarkBackward(torch.autograd.Function):
    """Identity; when autograd reaches it, opens (``"open"``) or closes (``"close"``) the
    backward interval held in ``box``, on the recorder current at that time."""

    @staticmethod
    def forward(fctx, x, ledger, box: dict, what: str):
        fctx.ledger, fctx.box, fctx.what = ledger, box, what
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        rec, box = fctx.ledger.intervals, fctx.box
        if rec is not None and fctx.what == "open":
            box["iv"] = rec.open(box["kind"], chunk=box["chunk"])
        elif rec is not None and "iv" in box:
            rec.close(box.pop("iv"))
        return grad, None, None, None


def timed(ledger, kind: str, fn, x: torch.Tensor, *args, chunk: int | None = None):
    """``fn(x, *args)``, recorded in ``ledger.intervals`` (if set) as a compute interval ``kind``;
    its backward, from the output's grad arriving to ``x``'s grad leaving, as ``kind + "_grad"``
    (identity autograd nodes on ``x`` and on the output mark the two ends). Without a recorder
    this is ``fn(x, *args)``."""
    rec = ledger.intervals
    if rec is None:
        return fn(x, *args)
    box = {"kind": kind + "_grad", "chunk": chunk}
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        x = _MarkBackward.apply(x, ledger, box, "close")
    with rec.compute(kind, chunk=chunk):
        y = fn(x, *args)
    if grad and y.requires_grad:
        y = _MarkBackward.apply(y, ledger, box, "open")
    return y
