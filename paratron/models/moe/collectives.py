"""The in-flight all-to-all of the overlapped MoE dispatchers: launched asynchronously, with a
backward split over two autograd nodes so that other work runs while it is on the wire.

The synchronous collectives and their adjoints (the uneven all-to-all, the row all-gather and
reduce-scatter) live in :mod:`paratron.parallel.mappings`; this module keeps only what overlapping
needs. Every call goes through a :class:`~paratron.parallel.comm.Group` method, so the comm ledger
counts calls and bytes (docs/DESIGN.md principle 8).

Tokens are rows: tensors here are ``[n, h]`` (or ``[n, ...]``), exchanged along dim 0
(GShard's dispatch/combine, Lepikhin et al. 2020, section 2.2).
"""

from __future__ import annotations

import torch

from paratron.parallel.comm import Group


def _rows_like(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.new_empty((n,) + tuple(t.shape[1:]))


class InFlight:
    """An all-to-all started by :func:`start_all_to_all`, in both directions.

    Forward: ``out`` (receive buffer), ``work``, ``send`` (kept alive until the exchange is done)
    and ``src`` (the rows, as a node of the autograd graph). Backward: the swapped all-to-all
    launched by the backward of :func:`finish_all_to_all` (``back_out``, ``back_work``,
    ``back_send``), waited for by the backward of the node :func:`start_all_to_all` put on ``src``.
    """

    def __init__(self, group: Group, out_splits: list[int], in_splits: list[int], kind: str, chunk):
        self.group, self.out_splits, self.in_splits = group, out_splits, in_splits
        self.kind, self.chunk = kind, chunk
        self.src = self.out = self.work = self.send = self.iv = None
        self.back_out = self.back_work = self.back_send = self.back_iv = None

    def _wait(self, work, iv) -> None:
        if work is not None:
            work.wait()
        rec = self.group.ledger.intervals
        if rec is not None and iv is not None:
            rec.waited(iv)

    def wait(self) -> torch.Tensor:
        """Wait for the forward exchange; the received rows."""
        self._wait(self.work, self.iv)
        out, self.out, self.send, self.work = self.out, None, None, None
        return out

    def arrive(self) -> None:
        """Block until the forward exchange has completed, leaving its rows to :meth:`wait`
        (the pipeline runtime's FB hook waits here, so that its next step starts after it)."""
        if self.work is not None:
            self.work.wait()

    def launch_back(self, grad: torch.Tensor) -> torch.Tensor:
        """Launch the swapped all-to-all of ``grad`` [sum(out_splits), ...]; the buffer it fills."""
        self.back_send = grad.contiguous()
        self.back_out = _rows_like(grad, sum(self.in_splits))
        self.back_work = self.group.all_to_all(self.back_out, self.back_send, self.in_splits, self.out_splits,
                                               async_op=True)
        rec = self.group.ledger.intervals
        if rec is not None:
            self.back_iv = rec.issued(self.kind + "_grad", self.back_work, chunk=self.chunk)
        return self.back_out

    def wait_back(self) -> torch.Tensor | None:
        """Wait for the swapped all-to-all; its rows (None if it was never launched)."""
        self._wait(self.back_work, self.back_iv)
        out, self.back_out, self.back_send, self.back_work = self.back_out, None, None, None
        return out


class _WaitGradOnBackward(torch.autograd.Function):
    """Identity; its backward waits for the flight's swapped all-to-all and hands on its rows."""

    @staticmethod
    def forward(fctx, x, flight: InFlight):
        fctx.flight = flight
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        back = fctx.flight.wait_back()
        return (grad if back is None else back), None


class _Landed(torch.autograd.Function):
    """The received rows of a flight; its backward launches the swapped all-to-all and returns
    the (not yet filled) buffer, which only :class:`_WaitGradOnBackward` reads, after waiting."""

    @staticmethod
    def forward(fctx, src, flight: InFlight):
        fctx.flight = flight
        return flight.wait()

    @staticmethod
    def backward(fctx, grad):
        return fctx.flight.launch_back(grad), None


def start_all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int], *,
                     kind: str = "all_to_all", chunk: int | None = None) -> InFlight:
    """Launch the all-to-all of :func:`paratron.parallel.mappings.all_to_all` asynchronously
    (``async_op``); the rows are usable, with their gradient, after :func:`finish_all_to_all`.
    ``kind``/``chunk`` name its interval in ``ledger.intervals`` (the backward's:
    ``kind + "_grad"``).

    Backward is asynchronous too: the backward of :func:`finish_all_to_all` launches the swapped
    all-to-all and the gradient of ``x`` waits for it only when autograd reaches the node put on
    ``x`` here. Autograd runs ready nodes latest-created first, so whatever was created between
    this call and :func:`finish_all_to_all` (e.g. another chunk's experts) runs in between.
    """
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"start_all_to_all: in_splits sum to {sum(in_splits)}, but x has {x.shape[0]} rows")
    flight = InFlight(group, list(out_splits), list(in_splits), kind, chunk)
    flight.src = _WaitGradOnBackward.apply(x, flight) if torch.is_grad_enabled() and x.requires_grad else x
    flight.send = x.detach().contiguous()
    flight.out = _rows_like(x, sum(out_splits))
    flight.work = group.all_to_all(flight.out, flight.send, flight.out_splits, flight.in_splits, async_op=True)
    rec = group.ledger.intervals
    if rec is not None:
        flight.iv = rec.issued(kind, flight.work, chunk=chunk)
    return flight


def finish_all_to_all(flight: InFlight) -> torch.Tensor:
    """Wait for ``flight`` and return the received rows ``[sum(out_splits), ...]``,
    differentiable with respect to the ``x`` it was started from (backward: see
    :func:`start_all_to_all`)."""
    src, flight.src = flight.src, None  # the graph holds it now; a flight holding it would make a cycle
    return _Landed.apply(src, flight)
