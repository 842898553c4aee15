"""Data parallelism: grads summed over DP ranks in buckets, overlapped with backward.

:class:`DistributedDataParallel` puts every trainable param of the model chunks into
:class:`~paratron.optim.grad_buffer.GradBuffer` s (one per param dtype and dense/expert kind),
then listens for grads:

* linear weights report through :func:`paratron.parallel.grads.accumulate_grad`, which adds into
  ``main_grad`` and calls ``param.grad_ready_hook``;
* every other param gets an autograd ``.grad``; a post-accumulate hook moves it into
  ``main_grad`` and reports it the same way.

**Once per step.** With gradient accumulation a param receives one grad per microbatch (more if
the model uses it twice); its bucket may only be reduced after the last. DDP counts the grad
events of each param during a step; the counts of the first step become the expected counts of
the following steps, so with ``overlap_grad_reduce`` a bucket's reduction starts (an async work
handle) as soon as every param in it has seen its expected number of grads, from the second step
on. No cooperation from the schedule is needed; :meth:`no_sync` can still hold every reduction
until :meth:`finish_grad_sync`. A grad that arrives after its bucket's reduction started raises
(call :meth:`recalibrate` when the number of microbatches per step changes).

Buckets of a buffer are launched strictly in index order, so every rank issues the same
collectives in the same order whatever the timing of its backward. Expert buffers are reduced
at :meth:`finish_grad_sync` only: an expert that receives no tokens on one rank produces no grad
events there, and an early launch on the other ranks would then mismatch the collective order.

Reduction is a plain SUM over the DP group: the training step divides the loss by the global
number of valid tokens before backward, so summed grads equal the single-device token mean.
Dense params reduce over ``ctx.dp_cp`` (``ctx.dp`` without context parallelism: CP ranks see
different tokens of the same sequences), expert params over ``ctx.expert_dp``. With
``use_distributed_optimizer`` (ZeRO-1) a bucket is reduce-scattered instead of all-reduced: rank
``r`` receives the summed grads of shard ``r`` of every bucket (Rajbhandari et al. 2020, section
5.1).

ZeRO stages 2 and 3 (``zero=2|3``) keep no full-size grad buffer: grads are staged per bucket and
reduce-scattered during backward by :class:`~paratron.optim.zero.ShardedGrads`, which also
holds the ZeRO-1 shards, so all three stages share one set of shard buffers. Stage 3 also shards
the params (:class:`~paratron.optim.param_gather.ParamShards`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratron.parallel.params import unique_params

from .grad_buffer import Bucket, GradBuffer
from .param_gather import ParamShards, unit_ids
from .zero import ShardedGrads


def chunk_params(chunks) -> list[nn.Parameter]:
    """Unique trainable params of ``chunks`` (a module or a list of modules), in registration
    order (a tied param shared by two chunks appears once)."""
    return unique_params(chunks, trainable_only=True)


def _needs_model_parallel_reduction(p) -> bool:
    return bool(getattr(p, "shared_embedding", False) or getattr(p, "sequence_parallel", False))


class _BucketState:
    """Per-step bookkeeping of one bucket: params still expected, and the reduction in flight."""

    __slots__ = ("pending", "launched", "handle")

    def __init__(self) -> None:
        self.pending = 0
        self.launched = False
        self.handle = None


class DistributedDataParallel:
    """Gradient buffers, buckets and their reduction over data-parallel ranks.

    Args:
        chunks: the model chunks (``nn.Module`` or list: one per virtual pipeline stage) of this
            rank. Every trainable param must carry :func:`paratron.parallel.params.mark`'s
            attributes.
        ctx: the :class:`~paratron.parallel.context.ParallelContext`.
        grad_dtype: dtype of the main grads (fp32).
        bucket_size_mb: MiB of grads per bucket (in ``grad_dtype``); <= 0: one bucket.
        overlap_grad_reduce: start each bucket's reduction during backward as soon as it is
            ready; else reduce everything in :meth:`finish_grad_sync`.
        use_distributed_optimizer: ZeRO-1: reduce-scatter grads (each DP rank keeps the summed
            grads of its shard of every bucket, in :attr:`shard_grads`).
        zero: the ZeRO stage 0-3 (overrides ``use_distributed_optimizer``; stage 1 is the same).
        zero3_reshard_after_forward: stage 3: free a unit's params after its forward.
        zero3_prefetch: stage 3: all-gather the next unit's params ahead of use.

    Raises:
        ValueError: a param was not marked (no ``logical_name``), no param is trainable, or
            ``zero`` is not 0..3.
    """

    def __init__(self, chunks, ctx, *, grad_dtype: torch.dtype = torch.float32,
                 bucket_size_mb: float = 40.0, overlap_grad_reduce: bool = True,
                 use_distributed_optimizer: bool = False, zero: int | None = None,
                 zero3_reshard_after_forward: bool = True, zero3_prefetch: bool = True) -> None:
        self.chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
        self.ctx = ctx
        self.grad_dtype = grad_dtype
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.zero = int(zero) if zero is not None else int(bool(use_distributed_optimizer))
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero={self.zero} must be 0, 1, 2 or 3")
        self.use_distributed_optimizer = self.zero >= 1
        params = chunk_params(self.chunks)
        if not params:
            raise ValueError("DistributedDataParallel: the model chunks have no trainable params")
        for p in params:
            if not hasattr(p, "logical_name"):
                raise ValueError(f"a param of shape {tuple(p.shape)} has no logical_name: every "
                                 "param must be marked with paratron.parallel.params.mark")
        bucket_numel = int(bucket_size_mb * 2**20) // torch.empty((), dtype=grad_dtype).element_size()

        # Reverse registration order approximates the order in which backward produces grads.
        kinds: dict[tuple[torch.dtype, bool], list] = {}
        for p in reversed(params):
            kinds.setdefault((p.dtype, bool(getattr(p, "is_expert", False))), []).append(p)
        units = unit_ids(self.chunks, params) if self.zero == 3 else {}
        self.buffers: list[GradBuffer] = []
        for (dtype, is_expert), ps in kinds.items():
            group = ctx.expert_dp if is_expert else ctx.dp_cp
            self.buffers.append(GradBuffer.build(
                ps, [_needs_model_parallel_reduction(p) for p in ps], group=group,
                is_expert=is_expert, grad_dtype=grad_dtype, bucket_numel=bucket_numel,
                units=[units.get(id(p), 0) for p in ps], allocate_grads=self.zero < 2))
        self.params = params

        # ZeRO: the summed grads of this rank's shard of each bucket land in shard_grads.
        self.sharded = ShardedGrads(self.buffers, self.zero, grad_dtype) if self.zero else None
        self.shard_grads = self.sharded.shard_grads if self.sharded else [[] for _ in self.buffers]
        self.param_shards = (ParamShards(self.buffers, self.chunks, prefetch=zero3_prefetch,
                                         reshard_after_forward=zero3_reshard_after_forward)
                             if self.zero == 3 else None)

        self._where: dict[int, tuple[int, int]] = {}
        for i, buf in enumerate(self.buffers):
            for b in buf.buckets:
                for p in b.params:
                    self._where[id(p)] = (i, b.index)
        self._counts: dict[int, int] = {id(p): 0 for p in params}
        self._expected: dict[int, int] | None = None
        self._sync_enabled = True
        self._states = [[_BucketState() for _ in buf.buckets] for buf in self.buffers]
        self._next = [0] * len(self.buffers)
        self._hooks = []
        for p in params:
            p.grad_ready_hook = self._grad_ready
            if self.zero >= 2:
                p.acquire_main_grad = self.sharded.acquire
            self._hooks.append(p.register_post_accumulate_grad_hook(self._autograd_grad_ready))
        self._reset_step()

    # ---- the per-step cycle ------------------------------------------------------------------
    def zero_grad_buffer(self) -> None:
        """Zero every main grad and start a new step (call before the first microbatch)."""
        self._reset_step()  # first: it waits for reductions still in flight on these buffers
        if self.sharded is not None:
            self.sharded.start_step()
        for buf in self.buffers:
            if buf.grad_data is not None:
                buf.grad_data.zero_()
        for p in self.params:
            p.grad = None

    @contextmanager
    def no_sync(self):
        """Inside this block grads accumulate but no bucket reduction starts."""
        prev = self._sync_enabled
        self.set_is_last_microbatch(False)
        try:
            yield
        finally:
            self.set_is_last_microbatch(prev)

    def set_is_last_microbatch(self, last: bool) -> None:
        """Megatron-style switch: ``False`` holds reductions back like :meth:`no_sync`."""
        self._sync_enabled = bool(last)
        if self.sharded is not None:
            self.sharded.sync_enabled = bool(last)

    def recalibrate(self) -> None:
        """Forget the expected grad counts (e.g. when the number of microbatches per step
        changes); the next step reduces at :meth:`finish_grad_sync` and learns them again."""
        self._expected = None
        self._reset_step()

    def start_deferred(self) -> None:
        """Launch, in order, every bucket not yet launched, including the deferred ones (call
        after the model-parallel all-reduces of tied-embedding and sequence-parallel grads)."""
        for i in range(len(self.buffers)):
            self._launch_upto(i, len(self.buffers[i].buckets))

    def finish_grad_sync(self) -> None:
        """Launch every remaining bucket (in order) and wait for all reductions.

        Afterwards the main grads (all-reduce) or :attr:`shard_grads` (ZeRO-1) hold the sum over
        the DP group. The grad counts of this step become the expected counts of the next.
        """
        if self.param_shards is not None:
            self.param_shards.release_all()
        if self.zero >= 2:
            self.sharded.finish()
            return
        self.start_deferred()
        for states in self._states:
            for st in states:
                if st.handle is not None:
                    st.handle.wait()
                    st.handle = None
        if self._expected is None or any(self._counts[k] != v for k, v in self._expected.items()):
            self._expected = dict(self._counts)

    # ---- grad events -------------------------------------------------------------------------
    def _autograd_grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        main = p.main_grad if getattr(p, "main_grad", None) is not None else self.sharded.acquire(p)
        main.add_(p.grad.view_as(main))
        p.grad = None
        self._grad_ready(p)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self.zero >= 2:
            self.sharded.grad_event(p)
            return
        key = id(p)
        i, k = self._where[key]
        st = self._states[i][k]
        if st.launched:
            raise RuntimeError(
                f"{p.logical_name} received a grad after its bucket's DP reduction started: it got "
                f"more grads this step than in the step that set the expected count "
                f"({self._expected.get(key) if self._expected else None}); call "
                "ddp.recalibrate() when the number of microbatches per step changes")
        self._counts[key] += 1
        if self._expected is None or not self.overlap_grad_reduce:
            return
        if self._counts[key] == self._expected.get(key, 0):
            st.pending -= 1
            if st.pending == 0 and self._sync_enabled:
                self._launch_ready(i)

    def _launch_ready(self, i: int) -> None:
        buf, states = self.buffers[i], self._states[i]
        if buf.is_expert:
            return
        n = self._next[i]
        while n < len(buf.buckets) and states[n].pending <= 0 and not buf.buckets[n].deferred:
            n += 1
        self._launch_upto(i, n)

    def _launch_upto(self, i: int, end: int) -> None:
        buf = self.buffers[i]
        while self._next[i] < end:
            k = self._next[i]
            self._launch(i, buf.buckets[k])
            self._next[i] = k + 1

    def _launch(self, i: int, bucket: Bucket) -> None:
        buf = self.buffers[i]
        st = self._states[i][bucket.index]
        flat = buf.grad_data[bucket.start:bucket.end]
        if self.use_distributed_optimizer:
            st.handle = buf.group.reduce_scatter_into(self.shard_grads[i][bucket.index], flat,
                                                      async_op=True)
        else:
            st.handle = buf.group.all_reduce(flat, async_op=True)
        st.launched = True

    def _reset_step(self) -> None:
        for key in self._counts:
            self._counts[key] = 0
        for i, buf in enumerate(self.buffers):
            self._next[i] = 0
            for b in buf.buckets:
                st = self._states[i][b.index]
                if st.handle is not None:
                    st.handle.wait()
                st.handle, st.launched = None, False
                exp = self._expected or {}
                st.pending = sum(1 for p in b.params if exp.get(id(p), 0) > 0)

    # ---- introspection -----------------------------------------------------------------------
    def owned_ranges(self, i: int) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, end, grads)`` for each flat range of buffer ``i`` this rank updates: the
        whole buffer without ZeRO, its shard of every bucket with ZeRO-1. ``grads`` is the
        ``[end - start]`` tensor that holds the DP-summed grads of the range after
        :meth:`finish_grad_sync`."""
        buf = self.buffers[i]
        if not self.use_distributed_optimizer:
            return [(0, buf.numel, buf.grad_data)]
        g = buf.group
        return [(*b.shard_range(max(g.rank, 0), g.size), self.shard_grads[i][b.index])
                for b in buf.buckets]

    @contextmanager
    def full_params(self, writeback: bool = False):
        """Inside the block every param holds its full (TP-local) tensor: a no-op below ZeRO-3;
        with ZeRO-3 every bucket is all-gathered for the block (costs a full copy of this rank's
        params), and with ``writeback`` changes are copied back into the shards at exit."""
        if self.param_shards is None:
            yield
            return
        with self.param_shards.gathered(writeback):
            yield

    def owned_params(self, i: int) -> list[torch.Tensor]:
        """The param storage of each range of :meth:`owned_ranges` (same order): slices of the
        full param buffer, or with ZeRO-3 this rank's param shard of each bucket."""
        if self.param_shards is not None:
            return list(self.param_shards.shards[i])
        return [self.buffers[i].param_data[s:e] for s, e, _ in self.owned_ranges(i)]

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The param and grad storage this rank holds now, by kind (for memory accounting)."""
        params = (self.param_shards.param_tensors() if self.param_shards is not None
                  else [b.param_data for b in self.buffers])
        grads = [b.grad_data for b in self.buffers if b.grad_data is not None]
        if self.sharded is not None:
            grads += self.sharded.grad_tensors()
        return {"params": params, "grads": grads}

    def num_launched(self) -> int:
        """Buckets whose reduction has started this step (for tests and logging)."""
        if self.zero >= 2:
            return self.sharded.flushes
        return sum(st.launched for states in self._states for st in states)

    def remove_hooks(self) -> None:
        """Detach the grad hooks (the buffers keep the params' data)."""
        for h in self._hooks:
            h.remove()
        if self.param_shards is not None:
            self.param_shards.remove_hooks()
        for p in self.params:
            if getattr(p, "grad_ready_hook", None) == self._grad_ready:
                del p.grad_ready_hook
            if hasattr(p, "acquire_main_grad"):
                del p.acquire_main_grad
