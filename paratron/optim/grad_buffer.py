"""Contiguous param and grad storage for data parallelism, split into buckets.

One :class:`GradBuffer` holds every parameter of one (param dtype, dense/expert) kind: a flat
``param_data`` in the param dtype and a flat ``grad_data`` in the grad dtype (fp32 main grads),
with the same layout. Each param's ``.data`` becomes a view into ``param_data`` and its
``main_grad`` a view into ``grad_data``, so one collective reduces a whole bucket, and ZeRO-1 can
all-gather updated params straight into place.

Layout (the same on every rank of the buffer's DP group, which is what lets a reduce-scatter hand
each rank the same slice of every bucket):

* params go in the order given (DDP passes reverse registration order, roughly the order in
  which backward produces grads; ZeRO-3 groups it by unit, below), each param whole inside one
  bucket;
* a bucket closes once it holds ``bucket_numel`` elements; its end is padded to a multiple of
  the DP size, so ZeRO-1 can split it into equal shards (Rajbhandari et al. 2020, section 5.1:
  each DP rank owns 1/N_d of the optimizer state; here 1/N_d of every bucket). A shard boundary
  may fall inside a param;
* "deferred" params (those whose grads need a model-parallel all-reduce first: tied embeddings,
  sequence-parallel norms) go last, in buckets of their own, which are reduced only after that
  all-reduce (see :mod:`paratron.optim.finalize`);
* ZeRO-3 passes a unit id per param (the module whose forward gathers it, see
  :mod:`paratron.optim.param_gather`): a unit's params are laid out side by side and a bucket
  never spans two units, so a unit is gathered as whole buckets, as few as its size needs.

With ZeRO-2/3 the buffer holds no full-size ``grad_data`` (``allocate_grads=False``): the grads
of a bucket live in a transient staging tensor (:mod:`paratron.optim.zero`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..parallel.comm import Group


@dataclass
class Bucket:
    """A contiguous range ``[start, end)`` of a buffer (``end`` padded to a DP-size multiple).

    Attributes:
        index: position in the buffer (buckets are reduced in index order on every rank).
        params: the params laid out inside the range.
        deferred: reduced only in ``finish_grad_sync`` (after the model-parallel all-reduces).
    """

    index: int
    start: int
    end: int
    params: list[torch.nn.Parameter]
    deferred: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        """``[start, end)`` (buffer offsets) of the slice that ZeRO-1 gives ``dp_rank``."""
        size = self.numel // dp_size
        s = self.start + dp_rank * size
        return s, s + size


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _layout(params, deferred, units, pad: int, limit) -> tuple[list[Bucket], dict[int, tuple[int, int]]]:
    """Buckets and flat offsets for ``params`` in order: a bucket closes at ``limit`` elements
    or where the deferred flag or the unit changes; its end is padded to a multiple of ``pad``."""
    buckets: list[Bucket] = []
    index: dict[int, tuple[int, int]] = {}
    offset, start, members, kind, unit = 0, 0, [], None, None

    def close() -> None:
        nonlocal offset, start, members
        if members:
            end = _round_up(offset, pad)
            buckets.append(Bucket(len(buckets), start, end, members, bool(kind)))
            offset = start = end
            members = []

    for p, d, u in zip(params, deferred, units):
        if members and (d != kind or u != unit or offset - start >= limit):
            close()
        kind, unit = d, u
        index[id(p)] = (offset, offset + p.numel())
        members.append(p)
        offset += p.numel()
    close()
    return buckets, index


@dataclass
class GradBuffer:
    """Flat param and grad storage for params of one dtype reduced over one DP group.

    Build with :meth:`build`. Attributes:
        group: the DP group the grads are summed over (``ctx.dp_cp`` dense, ``ctx.expert_dp``
            expert).
        is_expert: expert params (reduced over the expert-DP group).
        param_data: ``[numel]`` in the params' dtype; params' ``.data`` are views into it
            (ZeRO-3 replaces it with per-bucket shards, see :mod:`paratron.optim.param_gather`).
        grad_data: ``[numel]`` in the grad dtype; params' ``main_grad`` are views into it; None
            with ZeRO-2/3 (``allocate_grads=False``).
        buckets: in reduction order.
        index: ``param -> (start, end)`` flat offsets of the param inside the buffer.
        shapes: ``id(param) -> shape`` (ZeRO-3 empties ``.data`` between uses).
    """

    group: Group
    is_expert: bool
    param_data: torch.Tensor | None
    grad_data: torch.Tensor | None
    buckets: list[Bucket]
    index: dict[int, tuple[int, int]] = field(default_factory=dict)
    params: list[torch.nn.Parameter] = field(default_factory=list)
    shapes: dict[int, torch.Size] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")

    @property
    def numel(self) -> int:
        return self.buckets[-1].end if self.buckets else 0

    @classmethod
    def build(cls, params: list[torch.nn.Parameter], deferred: list[bool], *, group: Group,
              is_expert: bool, grad_dtype: torch.dtype, bucket_numel: int,
              units: list[int] | None = None, allocate_grads: bool = True) -> "GradBuffer":
        """Lay out ``params`` (all of one dtype and device), move their data into the buffer and
        attach ``main_grad`` views.

        Args:
            params: in bucket order.
            deferred: one flag per param (see module docstring).
            group: DP group; every bucket is padded to a multiple of ``group.size``.
            bucket_numel: elements per bucket (a bucket closes at or past this size); <= 0 puts
                every non-deferred param into one bucket.
            units: one id per param (ZeRO-3): a unit's params are placed together and a bucket
                also closes where the id changes.
            allocate_grads: allocate ``grad_data`` and attach ``main_grad`` views (DDP, ZeRO-1).

        Raises:
            ValueError: params of mixed dtypes or devices.
        """
        if not params:
            raise ValueError("GradBuffer.build needs at least one param")
        dtype, device = params[0].dtype, params[0].device
        for p in params:
            if p.dtype != dtype or p.device != device:
                raise ValueError(f"{p.meta.logical_name}: dtype {p.dtype} on {p.device} differs from the "
                                 f"buffer's {dtype} on {device}")
        pad = max(group.size, 1)
        limit = bucket_numel if bucket_numel > 0 else float("inf")
        units = list(units) if units is not None else [0] * len(params)
        # Non-deferred params first, then deferred ones; within each, a unit's params side by
        # side (in the order its first param came), so a unit is as few buckets as its size needs.
        first: dict[int, int] = {}
        for j, u in enumerate(units):
            first.setdefault(u, j)
        order = sorted(range(len(params)), key=lambda j: (bool(deferred[j]), first[units[j]]))
        ordered = [params[j] for j in order]
        flags = [deferred[j] for j in order]
        unit_of = [units[j] for j in order]

        buckets, index = _layout(ordered, flags, unit_of, pad, limit)
        total = buckets[-1].end
        param_data = torch.zeros(total, dtype=dtype, device=device)
        grad_data = torch.zeros(total, dtype=grad_dtype, device=device) if allocate_grads else None
        for p in ordered:
            s, e = index[id(p)]
            view = param_data[s:e].view_as(p)
            with torch.no_grad():
                view.copy_(p.data)
            p.data = view
            if grad_data is not None:
                p.meta.main_grad = grad_data[s:e].view_as(p)
        return cls(group, is_expert, param_data, grad_data, buckets, index, ordered,
                   {id(p): p.shape for p in ordered}, dtype, grad_dtype, device)
