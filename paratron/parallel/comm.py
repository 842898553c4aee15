"""Process-group handles and the communication ledger.

Every collective paratron issues goes through a :class:`Group` method, so that one place can count
calls and bytes per operation and per group (docs/DESIGN.md principle 8). The ledger is off by default;
when off, recording costs one attribute check. When ``ledger.flight`` holds a
:class:`~paratron.parallel.flight.FlightRecorder`, each call is also entered in that ring buffer
with its start and end times (the hang watchdog reads it). ``ledger.intervals`` (an
:class:`~paratron.parallel.intervals.IntervalRecorder`, or None) is where code that overlaps
communication with compute records both (:mod:`paratron.parallel.intervals`).

Groups of size 1 short-circuit: their collectives return the input without calling
``torch.distributed``, so model code written for N ranks runs unchanged on one process.

On the CPU (gloo) the all-gathers and SUM reduce-scatters run as one ``all_to_all_single`` each
(plus, for the reduce-scatter, a local sum of the received slices): gloo's own
reduce-scatter took 2-7x and its all-gather up to 2x the time of the exchange of the same bytes
(``benchmarks/README.md``, the ZeRO-3 section's "gloo's collectives as all-to-alls"), and ZeRO
and sequence parallelism issue them per bucket and per layer. Other devices (NCCL, the fake
backend of ``paratron dryrun`` on ``meta``) get the native collectives. The ledger and the
flight recorder see the logical op.

Devices: a group's collectives take tensors on the group's ``device`` (the context's device:
``cuda:N`` under NCCL) and raise ``ValueError`` otherwise, on every group size, so a CPU run
catches a tensor that NCCL would reject. Control traffic that belongs on the host (the stop
flag, object gathers) goes through the ``host_*`` methods, which take CPU tensors and reach
the process group's CPU backend (gloo; see docs/ARCHITECTURE.md, "Devices and backends").
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .collcheck import exchange
from .flight import FlightRecorder
from .objects import all_gather_objects


@dataclass
class LedgerEntry:
    calls: int = 0
    bytes: int = 0


class CommLedger:
    """Counts collective calls and payload bytes, keyed by ``(op, group_name)``.

    ``bytes`` is the size of the local input payload of the call (for all-gather the local shard,
    for reduce-scatter the full local input, for all-to-all the bytes sent including the ones
    kept locally, for p2p the bytes sent). Tests compare these with analytic volumes.

    ``used`` is kept whether or not counting is on: the names of the groups whose calls reached
    ``torch.distributed`` (one set insertion per call), i.e. the process groups a run needed.
    """

    def __init__(self) -> None:
        self.enabled = False
        self.entries: dict[tuple[str, str], LedgerEntry] = defaultdict(LedgerEntry)
        self.flight = None  # a FlightRecorder while the hang watchdog runs
        self.used: set[str] = set()  # groups (by name) that reached torch.distributed, always on
        self.intervals = None  # an IntervalRecorder (paratron.parallel.intervals) while timing overlap

    def record(self, op: str, group: str, nbytes: int) -> None:
        if self.enabled:
            e = self.entries[(op, group)]
            e.calls += 1
            e.bytes += int(nbytes)

    def reset(self) -> None:
        self.entries.clear()

    @contextmanager
    def recording(self):
        """Enable counting inside a ``with`` block (entries are reset on entry)."""
        self.reset()
        prev, self.enabled = self.enabled, True
        try:
            yield self
        finally:
            self.enabled = prev

    def total(self, op: str | None = None, group: str | None = None) -> LedgerEntry:
        out = LedgerEntry()
        for (o, g), e in self.entries.items():
            if (op is None or o == op) and (group is None or g == group):
                out.calls += e.calls
                out.bytes += e.bytes
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        return {f"{o}@{g}": {"calls": e.calls, "bytes": e.bytes} for (o, g), e in sorted(self.entries.items())}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    """``expected`` without an index matches any index of its type."""
    return actual.type == expected.type and (expected.index is None or actual.index == expected.index)


HOST = torch.device("cpu")


def _exchanged(device: torch.device) -> bool:
    """Whether all-gathers and SUM reduce-scatters on ``device`` run as all-to-alls (gloo: see the
    module docstring)."""
    return device.type == "cpu"


def _gather_by_exchange(out: torch.Tensor, t: torch.Tensor, size: int, pg, async_op: bool):
    """All-gather flat ``t`` into ``out`` as one all-to-all: every peer is sent the same ``t``."""
    return dist.all_to_all_single(out.view(-1), t.reshape(-1).repeat(size), group=pg, async_op=async_op)


class _SummedOnWait:
    """Work handle of a reduce-scatter run as an all-to-all: :meth:`wait` waits for the exchange,
    then sums the received slices (``[k, out.numel()]``, in group-rank order) into ``out``, and
    adds ``own`` (this rank's slice of the input, which was not sent to itself) when given."""

    def __init__(self, work, recv: torch.Tensor, out: torch.Tensor, k: int, own: torch.Tensor | None) -> None:
        self._work, self._recv, self._out, self._k, self._own = work, recv, out, k, own

    def wait(self, timeout=None) -> bool:
        if self._recv is not None:
            if self._work is not None:
                self._work.wait()
            out = self._out.view(-1)
            torch.sum(self._recv.view(self._k, -1), 0, out=out)
            if self._own is not None:
                out.add_(self._own)
            self._work = self._recv = self._own = None
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def get_future(self):
        if self._work is None:
            raise RuntimeError("the exchange has completed")
        return self._work.get_future()


def _scatter_by_exchange(out: torch.Tensor, t: torch.Tensor, size: int, rank: int, pg, async_op: bool):
    """Reduce-scatter (SUM) flat ``t`` into ``out`` as one all-to-all and a local sum.

    The first and the last rank of the group (both ranks of a pair) send the other ranks' slices,
    which lie side by side, and keep their own instead of sending it to themselves: the receive
    buffer is ``size - 1`` slices, not ``size``. Other ranks, and an ``out`` that shares storage
    with ``t``, exchange every slice."""
    flat = t.reshape(-1)
    shard = flat.numel() // size
    aliased = out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    edge = rank in (0, size - 1) and not aliased
    if edge:
        own = flat[rank * shard:(rank + 1) * shard]
        send = flat[shard:] if rank == 0 else flat[:-shard]
        splits = [0 if j == rank else shard for j in range(size)]
        recv = torch.empty(send.numel(), dtype=t.dtype, device=t.device)
        work = dist.all_to_all_single(recv, send, splits, splits, group=pg, async_op=async_op)
        handle = _SummedOnWait(work, recv, out, size - 1, own)
    else:
        recv = torch.empty(flat.numel(), dtype=t.dtype, device=t.device)
        work = dist.all_to_all_single(recv, flat, group=pg, async_op=async_op)
        handle = _SummedOnWait(work, recv, out, size, None)
    if not async_op:
        handle.wait()
        return None
    return handle


class GroupNotCreated(RuntimeError):
    """A collective on a group whose process group this run did not create: the context was built
    with ``kinds`` (the groups the run uses) that leave its kind out. The message names the op,
    the group, its ranks and the kinds that were created."""


@dataclass
class Group:
    """One process group as seen from this rank.

    Attributes:
        name: the group kind, e.g. ``"tp"``; used as the ledger key.
        ranks: global ranks in group order.
        rank: this rank's index in ``ranks`` (-1 when not a member).
        pg: the torch process group (None for size-1 groups, non-members and groups not
            created).
        ledger: the ledger shared by all groups of one parallel context.
        device: where the tensors of this group's collectives must live (``ctx.device``).
        created: False when the context left this group's kind out of the groups it created
            (``ParallelContext.build(kinds=...)``); a collective on it then raises
            :class:`GroupNotCreated` instead of silently running on the default group.
        created_kinds: the kinds the context did create (for that message).
    """

    name: str
    ranks: list[int]
    rank: int
    pg: object | None
    ledger: CommLedger = field(default_factory=CommLedger)
    device: torch.device = HOST
    created: bool = True
    created_kinds: tuple[str, ...] = ()

    def _handle(self, op: str):
        """The torch process group for ``op`` on a group of more than one rank; marks the group
        used (``ledger.used``). Raises :class:`GroupNotCreated` when it was not created."""
        if not self.created:
            raise GroupNotCreated(
                f"{op} on group {self.name!r} (ranks {self.ranks}): its process group was not created; "
                f"the context was built with kinds={self.created_kinds}. Add {self.name!r} where the "
                "run's groups are chosen (paratron/training/groups.py, groups_used)")
        self.ledger.used.add(self.name)
        return self.pg

    def _check(self, op: str, *tensors: torch.Tensor, device: torch.device | None = None) -> None:
        """Raise ValueError when a tensor handed to ``op`` is not on ``device`` (default: the
        group's); checked on every group size, so one process catches what NCCL would reject."""
        want = self.device if device is None else device
        for t in tensors:
            if not _same_device(t.device, want):
                raise ValueError(f"{op} on group {self.name!r}: tensor on {t.device}, but this group's "
                                 f"collectives take tensors on {want} (move it to ctx.device, or use "
                                 "a host_* method for host-side control values)")

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    # ---- flight recorder hook (one attribute check when off) ---------------------------------
    # Under torch.compile (model.compile traces the layers' collectives) only the attribute check
    # is traced: with no recorder the compiled graph stays whole. The recording itself runs
    # eagerly (torch.compiler.disable, a graph break around each recorded op), because traced it
    # would guard on the recorder's counters (a recompile per op until dynamo's limit) and could
    # not read the clock; skipping it while compiling instead would leave the compiled ops out of
    # the per-group numbers and fingerprints that ranks compare to find a hang or a mismatch.
    def _begin(self, op: str, t: torch.Tensor | None, reduce=None):
        """The flight entry of ``op`` on this group, opened now; None when no recorder runs."""
        fr = self.ledger.flight
        if fr is None:
            return None
        return self._record_begin(fr, op, t, reduce)

    @torch.compiler.disable
    def _record_begin(self, fr, op: str, t: torch.Tensor | None, reduce):
        entry = fr.begin(op, self.name, tuple(self.ranks), t, reduce)
        if fr.exhaustive and entry.cseq is not None:  # parallel.check_collectives
            exchange(self.pg, self.size, entry)
        return entry

    @staticmethod
    def _end(entry, work=None):
        """Close ``entry`` (if recording) now, or when ``work`` is seen completed; returns ``work``."""
        if entry is not None:
            FlightRecorder.finish(entry, work)
        return work

    # ---- collectives (in place where torch is) -------------------------------------------
    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """Sum (or ``op``) ``t`` in place over the group. Returns a work handle if async."""
        self._check("all_reduce", t)
        if self.size == 1:
            return None
        pg = self._handle("all_reduce")
        self.ledger.record("all_reduce", self.name, _nbytes(t))
        e = self._begin("all_reduce", t, op)
        return self._end(e, dist.all_reduce(t, op=op, group=pg, async_op=async_op))

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``t`` along ``dim`` (same shape on every rank)."""
        self._check("all_gather", t)
        if self.size == 1:
            return t
        pg = self._handle("all_gather")
        self.ledger.record("all_gather", self.name, _nbytes(t))
        moved = t.movedim(dim, 0).contiguous() if dim else t.contiguous()
        out = torch.empty((self.size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
        e = self._begin("all_gather", t)
        if _exchanged(t.device):
            self._end(e, _gather_by_exchange(out, moved, self.size, pg, False))
        else:
            self._end(e, dist.all_gather_single(out, moved, group=pg))
        return out.movedim(0, dim).contiguous() if dim else out

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, async_op: bool = False):
        """All-gather flat ``t`` into ``out`` (``out.numel() == size * t.numel()``)."""
        self._check("all_gather_into", out, t)
        if self.size == 1:
            if out.data_ptr() != t.data_ptr():
                out.copy_(t)
            return None
        pg = self._handle("all_gather")
        self.ledger.record("all_gather", self.name, _nbytes(t))
        e = self._begin("all_gather", t)
        if _exchanged(t.device):
            return self._end(e, _gather_by_exchange(out, t, self.size, pg, async_op))
        return self._end(e, dist.all_gather_single(out, t, group=pg, async_op=async_op))

    def reduce_scatter(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``t`` over the group and return this rank's 1/size slice along ``dim``."""
        self._check("reduce_scatter", t)
        if self.size == 1:
            return t
        pg = self._handle("reduce_scatter")
        self.ledger.record("reduce_scatter", self.name, _nbytes(t))
        moved = t.movedim(dim, 0).contiguous() if dim else t.contiguous()
        out = torch.empty((moved.shape[0] // self.size,) + tuple(moved.shape[1:]), dtype=t.dtype, device=t.device)
        e = self._begin("reduce_scatter", t, dist.ReduceOp.SUM)
        if _exchanged(t.device):
            self._end(e, _scatter_by_exchange(out, moved, self.size, self.rank, pg, False))
        else:
            self._end(e, dist.reduce_scatter_single(out, moved, group=pg))
        return out.movedim(0, dim).contiguous() if dim else out

    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor, op=dist.ReduceOp.SUM,
                            async_op: bool = False):
        """Reduce-scatter flat ``t`` into ``out`` (``t.numel() == size * out.numel()``)."""
        self._check("reduce_scatter_into", out, t)
        if self.size == 1:
            if out.data_ptr() != t.data_ptr():
                out.copy_(t)
            return None
        pg = self._handle("reduce_scatter")
        self.ledger.record("reduce_scatter", self.name, _nbytes(t))
        e = self._begin("reduce_scatter", t, op)
        if _exchanged(t.device) and op == dist.ReduceOp.SUM:
            return self._end(e, _scatter_by_exchange(out, t, self.size, self.rank, pg, async_op))
        return self._end(e, dist.reduce_scatter_single(out, t, op=op, group=pg, async_op=async_op))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None, async_op: bool = False):
        """``all_to_all_single`` with optional uneven splits along dim 0. Returns ``out``, or with
        ``async_op`` a work handle (None for a size-1 group: the copy is done)."""
        self._check("all_to_all", out, t)
        if self.size == 1:
            out.copy_(t)
            return None if async_op else out
        pg = self._handle("all_to_all")
        self.ledger.record("all_to_all", self.name, _nbytes(t))
        e = self._begin("all_to_all", t)
        work = self._end(e, dist.all_to_all_single(out, t, out_splits, in_splits, group=pg,
                                                   async_op=async_op))
        return work if async_op else out

    def broadcast(self, t: torch.Tensor, src_group_rank: int = 0):
        """Copy ``t`` of group rank ``src_group_rank`` into ``t`` on every rank."""
        self._check("broadcast", t)
        if self.size == 1:
            return None
        pg = self._handle("broadcast")
        self.ledger.record("broadcast", self.name, _nbytes(t))
        e = self._begin("broadcast", t)
        return self._end(e, dist.broadcast(t, src=self.ranks[src_group_rank], group=pg))

    def host_all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Sum (or ``op``) a small CPU tensor in place over the group, on the process group's
        CPU backend: host-side control values (e.g. the stop flag) that must not make the
        device wait. Raises ValueError when ``t`` is not on the CPU."""
        self._check("host_all_reduce", t, device=HOST)
        if self.size == 1:
            return
        pg = self._handle("host_all_reduce")
        self.ledger.record("host_all_reduce", self.name, _nbytes(t))
        e = self._begin("host_all_reduce", t, op)
        self._end(e, dist.all_reduce(t, op=op, group=pg))

    def all_gather_object(self, obj) -> list:
        """Gather one picklable object per rank (setup-time metadata only, never on a hot path;
        it travels on the CPU backend). On the CPU in fewer rounds than torch's
        (:func:`~paratron.parallel.objects.all_gather_objects`)."""
        if self.size == 1:
            return [obj]
        pg = self._handle("all_gather_object")
        self.ledger.record("all_gather_object", self.name, 0)
        e = self._begin("all_gather_object", None)
        if _exchanged(self.device):
            out = all_gather_objects(obj, pg)
            self._end(e)
            return out
        out = [None] * self.size
        self._end(e, dist.all_gather_object(out, obj, group=pg))
        return out

    def barrier(self) -> None:
        if self.size > 1:
            pg = self._handle("barrier")
            e = self._begin("barrier", None)
            self._end(e, dist.barrier(group=pg))

    # ---- point to point (pipeline) -------------------------------------------------------
    def p2p_op(self, kind: str, t: torch.Tensor, peer_group_rank: int) -> "dist.P2POp":
        """Build a ``P2POp`` (``kind`` is ``"send"`` or ``"recv"``) for ``batch_isend_irecv``.

        Sends are counted in the ledger as ``"send"``; receives as ``"recv"``.
        """
        self._check(kind, t)
        pg = self._handle(kind)
        self.ledger.record(kind, self.name, _nbytes(t))
        fn = dist.isend if kind == "send" else dist.irecv
        p2p = dist.P2POp(fn, t, self.ranks[peer_group_rank], group=pg)
        p2p.flight_entry = self._begin(kind, t)
        return p2p

    @staticmethod
    def batch_isend_irecv(ops: list) -> list:
        """``dist.batch_isend_irecv(ops)`` for ops built by :meth:`p2p_op`; returns the works.

        Each op's flight entry (if recording) is closed when its work is seen completed. A
        backend that coalesces the batch into fewer works gives every entry the last one."""
        works = dist.batch_isend_irecv(ops)
        for i, p2p in enumerate(ops):
            entry = getattr(p2p, "flight_entry", None)
            if entry is not None and works:
                entry.work = works[i] if len(works) == len(ops) else works[-1]
        return works
