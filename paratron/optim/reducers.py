"""How DDP reduces grads over data-parallel ranks: one reducer per ZeRO stage, chosen once.

:class:`~paratron.optim.ddp.DistributedDataParallel` keeps the grad buffers, the buckets and
the schedule bookkeeping (which params are ready, when the last backward of a chunk ends, the
launch order); the reducer decides what a bucket's reduction is and where the summed grads land
(Rajbhandari et al. 2020, "ZeRO", sections 5.1-5.3):

* :class:`AllReduceBuckets` (stage 0): each bucket of the full grad buffer is all-reduced in
  place; this rank updates the whole buffer.
* :class:`ReduceScatterBuckets` (stage 1, P_os): each bucket is reduce-scattered into this
  rank's shard of it (:attr:`shard_grads`); this rank updates its shards.
* :class:`StagedShards` (stages 2 and 3, P_os+g and P_os+g+p): no full grad buffer; grads are
  staged per bucket and reduce-scattered by their own rule during backward
  (:class:`~paratron.optim.zero.ShardedGrads`); stage 3 also shards the params
  (:class:`~paratron.optim.param_gather.ParamShards`).

The first two launch bucket reductions when DDP's schedule says a bucket is ready
(``launches_buckets``); the staged reducer takes every grad event itself (its ``grad_event``
returns True) and DDP's schedule launches nothing for it. All three share one rule for the
shards: rank ``r`` of a buffer's DP group owns slice ``r`` of every bucket.
"""

from __future__ import annotations

import torch

from .grad_buffer import Bucket, GradBuffer
from .param_gather import ParamShards, unit_ids
from .zero import ShardedGrads, check_zero_level


def _shard_ranges(buf: GradBuffer, shard_grads: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    g = buf.group
    return [(*b.shard_range(max(g.rank, 0), g.size), shard_grads[b.index]) for b in buf.buckets]


class AllReduceBuckets:
    """Stage 0: all-reduce (SUM) each bucket of the full grad buffer in place.

    Args:
        buffers: DDP's :class:`~paratron.optim.grad_buffer.GradBuffer` list.
        grad_dtype: dtype of the main grads (fp32).
        **_: the staged reducer's options (see :func:`reducer_class`), unused here.
    """

    stage = 0
    launches_buckets = True   # DDP's last-backward schedule launches each bucket
    allocates_grads = True    # DDP keeps a full-size grad buffer
    param_shards: ParamShards | None = None
    acquire = None            # main grads are views into the full buffer, never staged

    def __init__(self, buffers: list[GradBuffer], grad_dtype: torch.dtype, **_) -> None:
        self.buffers, self.grad_dtype = buffers, grad_dtype
        self.shard_grads: list[list[torch.Tensor]] = [[] for _ in buffers]
        self.launches = 0

    @staticmethod
    def bucket_units(chunks, params) -> dict[int, int]:
        """Unit id per param id that buckets must not straddle (none below ZeRO-3)."""
        return {}

    def start_step(self) -> None:
        """A new step: nothing is in flight (DDP waited for it)."""
        self.launches = 0

    def grad_event(self, p: torch.Tensor) -> bool:
        """``p`` received a grad: False, the schedule decides when its bucket is reduced."""
        return False

    def launch(self, i: int, bucket: Bucket):
        """Start the reduction of ``bucket`` of buffer ``i``; its async work handle."""
        buf = self.buffers[i]
        self.launches += 1
        return buf.group.all_reduce(buf.grad_data[bucket.start:bucket.end], async_op=True)

    def finish(self) -> None:
        """Before DDP waits for the launched buckets: nothing to do here."""

    def owned_ranges(self, i: int) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, end, grads)`` per flat range of buffer ``i`` this rank updates: all of it."""
        buf = self.buffers[i]
        return [(0, buf.numel, buf.grad_data)]

    def grad_tensors(self) -> list[torch.Tensor]:
        """Grad storage of the reducer's own (beyond DDP's full buffers): none."""
        return []


class ReduceScatterBuckets(AllReduceBuckets):
    """Stage 1: reduce-scatter each bucket of the full grad buffer into this rank's shard
    (``shard_grads[i][k]``, ``[bucket.numel / N_d]`` fp32)."""

    stage = 1

    def __init__(self, buffers: list[GradBuffer], grad_dtype: torch.dtype, **_) -> None:
        super().__init__(buffers, grad_dtype)
        # A ShardedGrads at stage 1 holds only the shards (no staging).
        self.sharded = ShardedGrads(buffers, 1, grad_dtype)
        self.shard_grads = self.sharded.shard_grads

    def start_step(self) -> None:
        """Zero the shard grads."""
        super().start_step()
        self.sharded.start_step()

    def launch(self, i: int, bucket: Bucket):
        buf = self.buffers[i]
        self.launches += 1
        return buf.group.reduce_scatter_into(self.shard_grads[i][bucket.index],
                                             buf.grad_data[bucket.start:bucket.end], async_op=True)

    def owned_ranges(self, i: int) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's shard of every bucket of buffer ``i``."""
        return _shard_ranges(self.buffers[i], self.shard_grads[i])

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.sharded.grad_tensors()


class StagedShards:
    """Stages 2 and 3: grads staged per bucket and reduce-scattered as soon as every param of
    the bucket has one (:class:`~paratron.optim.zero.ShardedGrads`); stage 3 also keeps only a
    shard of the params (:class:`~paratron.optim.param_gather.ParamShards`).

    Args:
        buffers: DDP's buffers (built without full grads).
        grad_dtype: dtype of the main grads (fp32).
        stage: 2 or 3.
        chunks: the model chunks (stage 3 hooks their units).
        prefetch, reshard_after_forward: stage 3's :class:`ParamShards` options.
    """

    launches_buckets = False   # flushes by its own rule; DDP's schedule launches nothing
    allocates_grads = False

    def __init__(self, buffers: list[GradBuffer], grad_dtype: torch.dtype, *, stage: int, chunks=(),
                 prefetch: bool = True, reshard_after_forward: bool = True) -> None:
        self.stage, self.buffers = stage, buffers
        self.sharded = ShardedGrads(buffers, stage, grad_dtype)
        self.shard_grads = self.sharded.shard_grads
        self.param_shards = (ParamShards(buffers, chunks, prefetch=prefetch,
                                         reshard_after_forward=reshard_after_forward)
                             if stage == 3 else None)
        self.acquire = self.sharded.acquire

    @staticmethod
    def bucket_units(chunks, params) -> dict[int, int]:
        """Stage 3: the ZeRO-3 unit of each param (a bucket never spans two units)."""
        return unit_ids(chunks, params)

    def grad_event(self, p: torch.Tensor) -> bool:
        """``p`` received a grad: flush its bucket if every param of it has one; True (handled
        here, not by the schedule)."""
        self.sharded.grad_event(p)
        return True

    @property
    def launches(self) -> int:
        """Bucket flushes (reduce-scatters) started this step."""
        return self.sharded.flushes

    def start_step(self) -> None:
        """Zero the shard grads and drop staged grads (see :meth:`ShardedGrads.start_step`)."""
        self.sharded.start_step()

    def finish(self) -> None:
        """End of the step's backward: free gathered params (stage 3), flush every bucket still
        holding grads and wait; afterwards :attr:`shard_grads` hold the DP sums."""
        if self.param_shards is not None:
            self.param_shards.release_all()
        self.sharded.finish()

    def owned_ranges(self, i: int) -> list[tuple[int, int, torch.Tensor]]:
        """This rank's shard of every bucket of buffer ``i``."""
        return _shard_ranges(self.buffers[i], self.shard_grads[i])

    def grad_tensors(self) -> list[torch.Tensor]:
        return self.sharded.grad_tensors()


def reducer_class(stage: int):
    """The reducer class of ZeRO stage ``stage``. Every class is built as
    ``cls(buffers, grad_dtype, stage=, chunks=, prefetch=, reshard_after_forward=)`` (the
    bucket reducers ignore what they do not use).

    Raises:
        ValueError: ``stage`` is not 0, 1, 2 or 3 (:func:`~paratron.optim.zero.check_zero_level`).
    """
    check_zero_level(stage)
    return (AllReduceBuckets, ReduceScatterBuckets, StagedShards, StagedShards)[stage]

