"""Autograd-aware collectives over the tensor-parallel group: the f/g conjugate pairs.

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", section 3, figure 3) brackets every
split region of a transformer layer with two operators: ``f`` (identity forward, all-reduce
backward) where a replicated activation enters the region, and ``g`` (all-reduce forward,
identity backward) where partial sums leave it. Sequence parallelism (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2, figure 5)
replaces them by ``g`` = all-gather along the sequence (reduce-scatter backward) and
``g-bar`` = reduce-scatter along the sequence (all-gather backward), so that the activations
between regions stay split along the sequence.

Every function takes the activation and the TP :class:`~paratron.parallel.comm.Group`
(``ctx.tp``), and issues its collectives through that group, so the communication ledger counts
them. With a group of size 1 each function returns its input unchanged (no autograd node).

Layout: activations are ``[s, b, h]``; "last dim" means ``h`` (or any last dim), "dim 0" means
the sequence ``s``.
"""

from __future__ import annotations

import torch

from .comm import Group

__all__ = [
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


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    n = x.shape[-1]
    if n % group.size:
        raise ValueError(f"last dim {n} is not divisible by parallel.tensor={group.size}")
    step = n // group.size
    return x[..., group.rank * step:(group.rank + 1) * step].contiguous()


def _split_first(x: torch.Tensor, group: Group) -> torch.Tensor:
    check_sequence_divisible(x.shape[0], group)
    step = x.shape[0] // group.size
    return x[group.rank * step:(group.rank + 1) * step].contiguous()


def _all_reduce_copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    # A fresh buffer: autograd may still hold the incoming tensor (e.g. as another op's input).
    out = x.contiguous().clone() if x.is_contiguous() else x.contiguous()
    group.all_reduce(out)
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


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(fctx, grad):
        return fctx.group.all_gather(grad, dim=grad.dim() - 1), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return group.all_gather(x, dim=x.dim() - 1)

    @staticmethod
    def backward(fctx, grad):
        return _split_last(grad, fctx.group), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group, grad_is_partial):
        fctx.group, fctx.grad_is_partial = group, grad_is_partial
        return group.all_gather(x, dim=0)

    @staticmethod
    def backward(fctx, grad):
        if fctx.grad_is_partial:
            return fctx.group.reduce_scatter(grad, dim=0), None, None
        return _split_first(grad, fctx.group), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return group.reduce_scatter(x, dim=0)

    @staticmethod
    def backward(fctx, grad):
        return fctx.group.all_gather(grad, dim=0), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return _split_first(x, group)

    @staticmethod
    def backward(fctx, grad):
        return fctx.group.all_gather(grad, dim=0), None


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
    if group.size == 1:
        return x
    return _ScatterLast.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather along the last dim; the backward keeps this rank's slice of the grad
    (Shoeybi et al. 2019, section 3: the optional gather of a column-parallel output).

    Args:
        x: ``[..., n / tp]``.
        group: the TP group.
    Returns: ``[..., n]``, slices in TP-rank order.
    """
    if group.size == 1:
        return x
    return _GatherLast.apply(x, group)


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
    if group.size == 1:
        return x
    return _GatherSeq.apply(x, group, grad_is_partial)


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
    if group.size == 1:
        return x
    check_sequence_divisible(x.shape[0], group)
    return _ReduceScatterSeq.apply(x, group)


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
    if group.size == 1:
        return x
    return _ScatterSeq.apply(x, group)
