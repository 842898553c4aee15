"""Autograd-aware collectives used by the MoE token dispatchers.

Each function is a forward collective paired with the collective that is its exact adjoint, so
gradients stay correct across ranks. Every call goes through a :class:`~paratron.parallel.comm.Group`
method, so the comm ledger counts calls and bytes (docs/DESIGN.md principle 8).

Tokens are rows: tensors here are ``[n, h]`` (or ``[n, ...]``), split and gathered along dim 0.

Sources: the all-to-all dispatch/combine pair of GShard (Lepikhin et al. 2020, section 2.2) and
the all-gather/reduce-scatter conjugate pair of Megatron's sequence parallelism (Korthikanti et al.
2022, section 4.2.2).
"""

from __future__ import annotations

import torch

from paratron.parallel.comm import Group


def _rows_like(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.new_empty((n,) + tuple(t.shape[1:]))


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group: Group, out_splits: list[int], in_splits: list[int]):
        fctx.group, fctx.out_splits, fctx.in_splits = group, out_splits, in_splits
        out = _rows_like(x, sum(out_splits))
        group.all_to_all(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(fctx, grad):
        # The adjoint of an all-to-all is the all-to-all with the splits swapped.
        back = _rows_like(grad, sum(fctx.in_splits))
        fctx.group.all_to_all(back, grad.contiguous(), fctx.in_splits, fctx.out_splits)
        return back, None, None, None


def all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Exchange rows of ``x`` [n, ...] over ``group`` with uneven splits (differentiable).

    Args:
        x: rows to send, ``in_splits[j]`` consecutive rows to group rank ``j``.
        out_splits: rows received from each group rank, in group order.
        in_splits: rows sent to each group rank; ``sum(in_splits) == x.shape[0]``.

    Returns:
        ``[sum(out_splits), ...]``, rows ordered by source rank. Backward runs the swapped
        all-to-all, so every rank of ``group`` must run the backward.
    """
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"all_to_all: in_splits sum to {sum(in_splits)}, but x has {x.shape[0]} rows")
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits))


class InFlight:
    """An all-to-all started by :func:`start_all_to_all`: the receive buffer, the work handle, and
    the send buffer kept alive until the exchange is done."""

    def __init__(self, out, work, send, group: Group, out_splits: list[int], in_splits: list[int]):
        self.out, self.work, self.send = out, work, send
        self.group, self.out_splits, self.in_splits = group, out_splits, in_splits

    def wait(self) -> None:
        """Block until the rows have arrived (again: no-op)."""
        if self.work is not None:
            self.work.wait()
            self.work = None


def start_all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int]) -> InFlight:
    """Launch the all-to-all of :func:`all_to_all` asynchronously (``async_op``); the rows are
    usable, with their gradient, after :func:`finish_all_to_all`."""
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"start_all_to_all: in_splits sum to {sum(in_splits)}, but x has {x.shape[0]} rows")
    send = x.detach().contiguous()
    out = _rows_like(x, sum(out_splits))
    work = group.all_to_all(out, send, list(out_splits), list(in_splits), async_op=True)
    return InFlight(out, work, send, group, list(out_splits), list(in_splits))


class _Landed(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, flight: InFlight):
        flight.wait()
        fctx.group, fctx.out_splits, fctx.in_splits = flight.group, flight.out_splits, flight.in_splits
        return flight.out

    @staticmethod
    def backward(fctx, grad):
        back = _rows_like(grad, sum(fctx.in_splits))
        fctx.group.all_to_all(back, grad.contiguous(), fctx.in_splits, fctx.out_splits)
        return back, None


def finish_all_to_all(x: torch.Tensor, flight: InFlight) -> torch.Tensor:
    """Wait for ``flight`` (started from ``x``) and return the received rows, differentiable with
    respect to ``x`` (backward: the swapped all-to-all, run synchronously)."""
    return _Landed.apply(x, flight)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group: Group, grad_is_partial: bool):
        fctx.group, fctx.partial = group, grad_is_partial
        return group.all_gather(x.contiguous(), 0)

    @staticmethod
    def backward(fctx, grad):
        g = fctx.group
        if fctx.partial:
            return g.reduce_scatter(grad.contiguous(), 0), None, None
        n = grad.shape[0] // g.size
        return grad[g.rank * n:(g.rank + 1) * n].contiguous(), None, None


def gather_rows(x: torch.Tensor, group: Group, grad_is_partial: bool) -> torch.Tensor:
    """All-gather ``x`` [n, ...] along dim 0 over ``group`` -> ``[size * n, ...]`` (differentiable).

    Args:
        grad_is_partial: True when each rank's use of the gathered rows yields a *partial* grad
            (each rank used different parts), so backward sums them with a reduce-scatter; False
            when every rank computes the same function of the gathered rows (replicated
            consumers, e.g. the TP ranks without sequence parallelism), so backward keeps this
            rank's slice of the identical grad.
    """
    if group.size == 1:
        return x
    return _GatherRows.apply(x, group, grad_is_partial)


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group: Group):
        fctx.group = group
        return group.reduce_scatter(x.contiguous(), 0)

    @staticmethod
    def backward(fctx, grad):
        return fctx.group.all_gather(grad.contiguous(), 0), None


def reduce_scatter_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` [size * n, ...] over ``group`` and keep this rank's ``[n, ...]`` rows
    (differentiable: backward is an all-gather)."""
    if x.shape[0] % group.size:
        raise ValueError(f"reduce_scatter_rows: {x.shape[0]} rows are not divisible by the "
                         f"{group.name} group size {group.size}")
    if group.size == 1:
        return x
    return _ReduceScatterRows.apply(x, group)


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group: Group):
        fctx.group = group
        n = x.shape[0] // group.size
        return x[group.rank * n:(group.rank + 1) * n].contiguous()

    @staticmethod
    def backward(fctx, grad):
        return fctx.group.all_gather(grad.contiguous(), 0), None


def split_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's 1/size of the rows of a replicated ``x`` [n, ...] (differentiable).

    Backward all-gathers, so the grad of ``x`` is again the full, identical grad on every rank
    (Megatron's scatter-to-sequence-parallel-region, Korthikanti et al. 2022, section 4.2.2).

    Raises:
        ValueError: the row count is not divisible by the group size.
    """
    if x.shape[0] % group.size:
        raise ValueError(f"split_rows: {x.shape[0]} rows are not divisible by the {group.name} "
                         f"group size {group.size}")
    if group.size == 1:
        return x
    return _SplitRows.apply(x, group)
