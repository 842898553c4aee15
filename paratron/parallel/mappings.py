"""Autograd-aware collectives: every forward collective with the collective that is its adjoint.

This module is the one home of paratron's differentiable collectives (as Megatron-LM's
``tensor_parallel/mappings.py``); tensor, sequence, expert and context parallelism all call it.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3, figure 3) brackets every
split region of a transformer layer with two operators: ``f`` (identity forward, all-reduce
backward) where a replicated activation enters the region, and ``g`` (all-reduce forward,
identity backward) where partial sums leave it. Sequence parallelism (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2, figure 5)
replaces them by ``g`` = all-gather along the sequence (reduce-scatter backward) and
``g-bar`` = reduce-scatter along the sequence (all-gather backward), so that the activations
between regions stay split along the sequence.

The pairs, each parameterised by the dim it works along:

* :func:`gather_along_dim` / :func:`reduce_scatter_along_dim` / :func:`split_along_dim`
  (the TP and SP names below are these along the last dim or dim 0; MoE uses them on token rows);
* :func:`all_to_all`: the uneven all-to-all of rows whose adjoint swaps the splits (the MoE
  token dispatchers; GShard, Lepikhin et al. 2020, section 2.2), and the Ulysses head/sequence
  exchange built on it (:func:`all_to_all_seq_to_heads`, :func:`all_to_all_heads_to_seq`).

Asynchronous, in-flight all-to-alls (whose backward is split across two autograd nodes) belong to
the MoE dispatcher that overlaps them (:mod:`paratron.models.moe.collectives`).

Every function takes the tensor and a :class:`~paratron.parallel.comm.Group` (``ctx.tp``,
``ctx.ep``, ``ctx.cp``...) and issues its collectives through that group, so the communication
ledger counts them. With a group of size 1 the gather/scatter/reduce functions return their
input unchanged (no autograd node).

Layout: activations are ``[s, b, h]``; "last dim" means ``h`` (or any last dim), "dim 0" means
the sequence ``s`` (or the token rows ``[n, h]`` of MoE).
"""

from __future__ import annotations

import torch

from .comm import Group

__all__ = [
    "gather_along_dim", "reduce_scatter_along_dim", "split_along_dim", "all_to_all",
    "all_to_all_seq_to_heads", "all_to_all_heads_to_seq",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region", "check_sequence_divisible",
]


def check_sequence_divisible(seq_length: int, group: Group) -> None:
    """Raise before any collective when the sequence cannot be split evenly over TP.

    Raises:
        ValueError: ``seq_length % group.size != 0`` (sequence parallelism needs every TP rank to
            hold ``seq_length / parallel.tensor`` positions).
    """
    if seq_length % group.size:
        raise ValueError(
            f"seq_length={seq_length} is not divisible by parallel.tensor={group.size}, which "
            "sequence parallelism needs (each TP rank holds seq_length/parallel.tensor positions)")


def _check_divisible(x: torch.Tensor, group: Group, dim: int) -> None:
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by the {group.name} "
                         f"group size {group.size}")


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's contiguous ``1 / group.size`` of ``x`` along ``dim`` (a copy)."""
    _check_divisible(x, group, dim)
    step = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * step, step).contiguous()


def _all_reduce_copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    # A fresh buffer: autograd may still hold the incoming tensor (e.g. as another op's input).
    out = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
    group.all_reduce(out)
    return out


def _exchange(group: Group, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
              kind: str | None) -> torch.Tensor:
    """Synchronous all-to-all of the rows of ``x``; one comm interval named ``kind`` in
    ``ledger.intervals`` when a timeline is recorded and ``kind`` is given."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    rec = group.ledger.intervals if kind is not None else None
    iv = None if rec is None else rec.open(kind, comm=True)
    group.all_to_all(out, x.contiguous(), out_splits, in_splits)
    if iv is not None:
        rec.close(iv)
    return out


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(fctx, grad):
        return _all_reduce_copy(grad, fctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group):
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(fctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; backward: reduce-scatter (partial grads) or this rank's slice."""

    @staticmethod
    def forward(fctx, x, group, dim, grad_is_partial):
        fctx.group, fctx.dim, fctx.grad_is_partial = group, dim, grad_is_partial
        return group.all_gather(x.contiguous(), dim=dim)

    @staticmethod
    def backward(fctx, grad):
        if fctx.grad_is_partial:
            return fctx.group.reduce_scatter(grad.contiguous(), dim=fctx.dim), None, None, None
        return _split(grad, fctx.group, fctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(fctx, x, group, dim):
        fctx.group, fctx.dim = group, dim
        return group.reduce_scatter(x.contiguous(), dim=dim)

    @staticmethod
    def backward(fctx, grad):
        return fctx.group.all_gather(grad.contiguous(), dim=fctx.dim), None, None


class _Split(torch.autograd.Function):
    """This rank's slice along ``dim``; backward: all-gather along ``dim``."""

    @staticmethod
    def forward(fctx, x, group, dim):
        fctx.group, fctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(fctx, grad):
        return fctx.group.all_gather(grad.contiguous(), dim=fctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all of rows; its adjoint is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(fctx, x, group, out_splits, in_splits, kind):
        fctx.group, fctx.out_splits, fctx.in_splits, fctx.kind = group, out_splits, in_splits, kind
        return _exchange(group, x, out_splits, in_splits, kind)

    @staticmethod
    def backward(fctx, grad):
        kind = None if fctx.kind is None else fctx.kind + "_grad"
        return _exchange(fctx.group, grad, fctx.in_splits, fctx.out_splits, kind), None, None, None, None


# ---- dim-parameterised pairs (the building blocks) -------------------------------------------
def gather_along_dim(x: torch.Tensor, group: Group, dim: int, grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` over ``group`` (differentiable).

    Args:
        x: any shape; ``x.shape[dim]`` is ``n``.
        group: the group to gather over.
        dim: the dim to concatenate along (negative counts from the end).
        grad_is_partial: True when each rank's use of the gathered tensor yields a *partial*
            grad (each rank used different parts), so backward sums them with a reduce-scatter;
            False when every rank computes the same function of it (replicated consumers), so
            backward keeps this rank's slice of the identical grad.
    Returns: ``x`` with ``group.size * n`` along ``dim``, the ranks' parts in group order.
    """
    if group.size == 1:
        return x
    return _Gather.apply(x, group, dim % x.dim(), grad_is_partial)


def reduce_scatter_along_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's ``1 / size`` along ``dim`` (differentiable:
    backward all-gathers along ``dim``).

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size (before any collective).
    """
    _check_divisible(x, group, dim)
    if group.size == 1:
        return x
    return _ReduceScatter.apply(x, group, dim % x.dim())


def split_along_dim(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Keep this rank's contiguous ``1 / size`` of a replicated ``x`` along ``dim``
    (differentiable: backward all-gathers, so the grad of ``x`` is again the full grad).

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by the group size.
    """
    _check_divisible(x, group, dim)
    if group.size == 1:
        return x
    return _Split.apply(x, group, dim % x.dim())


def all_to_all(x: torch.Tensor, group: Group, out_splits: list[int], in_splits: list[int],
               kind: str | None = "all_to_all") -> torch.Tensor:
    """Exchange rows of ``x`` ``[n, ...]`` over ``group`` with uneven splits (differentiable;
    the all-to-all dispatch/combine of GShard, Lepikhin et al. 2020, section 2.2).

    Args:
        x: rows to send, ``in_splits[j]`` consecutive rows to group rank ``j``.
        out_splits: rows received from each group rank, in group order.
        in_splits: rows sent to each group rank; ``sum(in_splits) == x.shape[0]``.
        kind: the name of the forward interval in ``ledger.intervals`` (backward:
            ``kind + "_grad"``); None records none.
    Returns:
        ``[sum(out_splits), ...]``, rows ordered by source rank. Backward runs the swapped
        all-to-all, so every rank of ``group`` must run the backward.
    Raises:
        ValueError: ``in_splits`` do not sum to the row count.
    """
    if sum(in_splits) != x.shape[0]:
        raise ValueError(f"all_to_all: in_splits sum to {sum(in_splits)}, but x has {x.shape[0]} rows")
    return _AllToAll.apply(x, group, list(out_splits), list(in_splits), kind)


def all_to_all_seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[s/C, b, n, d]`` (sequence shards) -> ``[s, b, n/C, d]`` (head shards) over the
    ``C = group.size`` ranks of ``group``: the first all-to-all of DeepSpeed-Ulysses (Jacobs et
    al. 2023, section 3). Rank ``p`` gets head part ``p`` of every rank's tokens, in rank order
    (so the sequence is in natural order when each rank holds a contiguous ``s/C``).
    Backward is :func:`all_to_all_heads_to_seq` of the grad."""
    s, b, n, d = x.shape
    c = group.size
    send = x.reshape(s, b, c, n // c, d).permute(2, 0, 1, 3, 4).reshape(c * s, b, n // c, d)
    return all_to_all(send, group, [s] * c, [s] * c, kind=None)


def all_to_all_heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``[s, b, n/C, d]`` (head shards) -> ``[s/C, b, n, d]`` (sequence shards): the inverse of
    :func:`all_to_all_seq_to_heads` (the second all-to-all of Ulysses)."""
    s_full, b, n_part, d = x.shape
    c = group.size
    recv = all_to_all(x, group, [s_full // c] * c, [s_full // c] * c, kind=None)  # [p]: head part p
    return recv.reshape(c, s_full // c, b, n_part, d).permute(1, 2, 0, 3, 4).reshape(s_full // c, b, c * n_part, d)


# ---- the tensor- and sequence-parallel names (Megatron-LM's) ----------------------------------
def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``f`` of Shoeybi et al. 2019 (section 3): identity forward, all-reduce of the grad backward.

    Args:
        x: a replicated activation entering a TP region, any shape (e.g. ``[s, b, h]``).
        group: the TP group (``ctx.tp``).
    Returns: ``x`` (same shape); its gradient is summed over the group.
    """
    if group.size == 1:
        return x
    return _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``g`` of Shoeybi et al. 2019 (section 3): all-reduce (sum) forward, identity backward.

    Args:
        x: partial sums leaving a TP region, any shape (e.g. ``[s, b, h]``).
        group: the TP group.
    Returns: the sum over the group, same shape, identical on every rank.
    """
    if group.size == 1:
        return x
    return _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dim; the backward all-gathers the grad (Shoeybi et al.
    2019, section 3, used when a row-parallel layer gets an unsplit input).

    Args:
        x: ``[..., n]`` replicated.
        group: the TP group.
    Returns: ``[..., n / tp]``, slice ``tp_rank``.
    Raises:
        ValueError: ``n`` is not divisible by the group size.
    """
    if group.size > 1 and x.shape[-1] % group.size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by parallel.tensor={group.size}")
    return split_along_dim(x, group, -1)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim; the backward keeps this rank's slice of the grad
    (Shoeybi et al. 2019, section 3: the optional gather of a column-parallel output).

    Args:
        x: ``[..., n / tp]``.
        group: the TP group.
    Returns: ``[..., n]``, slices in TP-rank order.
    """
    return gather_along_dim(x, group, -1, grad_is_partial=False)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group,
                                         grad_is_partial: bool = True) -> torch.Tensor:
    """``g`` of Korthikanti et al. 2022 (section 4.2.2): all-gather along the sequence (dim 0).

    Backward: reduce-scatter along dim 0 when the consumer is a TP region (each rank's grad is a
    partial sum, ``grad_is_partial=True``, the default), else keep this rank's slice of the grad.

    Args:
        x: ``[s / tp, b, h]``.
        group: the TP group.
    Returns: ``[s, b, h]``, shards in TP-rank order.
    """
    return gather_along_dim(x, group, 0, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``g-bar`` of Korthikanti et al. 2022 (section 4.2.2): sum over the group and keep this
    rank's slice of the sequence (dim 0); the backward all-gathers the grad along dim 0.

    Args:
        x: ``[s, b, h]`` partial sums.
        group: the TP group.
    Returns: ``[s / tp, b, h]``.
    Raises:
        ValueError: ``s`` is not divisible by the group size (checked before any collective).
    """
    check_sequence_divisible(x.shape[0], group)
    return reduce_scatter_along_dim(x, group, 0)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0) of a replicated activation; the backward
    all-gathers the grad (Korthikanti et al. 2022, section 4.2.2: entering the SP layout).

    Args:
        x: ``[s, b, h]`` replicated.
        group: the TP group.
    Returns: ``[s / tp, b, h]``.
    Raises:
        ValueError: ``s`` is not divisible by the group size.
    """
    check_sequence_divisible(x.shape[0], group)
    return split_along_dim(x, group, 0)
