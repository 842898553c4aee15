"""Data parallelism: grads summed over DP ranks in buckets, overlapped with backward.

:class:`DistributedDataParallel` puts every trainable param of the model chunks into
:class:`~paratron.optim.grad_buffer.GradBuffer` s (one per param dtype and dense/expert kind),
then listens for grads:

* linear weights report through :func:`paratron.parallel.grads.accumulate_grad`, which adds into
  ``param.meta.main_grad`` and calls ``param.meta.grad_ready_hook``;
* every other param gets an autograd ``.grad``; a post-accumulate hook moves it into
  ``main_grad`` and reports it the same way (the word embedding's is sparse, its looked-up rows
  only, added row by row).

**When a bucket may be reduced: the schedule says so.** With gradient accumulation a param
receives grads in every microbatch; its bucket may only be reduced after the last one. DDP never
guesses that from grad counts. Whoever runs the backward passes declares the *last* backward of
each model chunk in the step with :meth:`last_backward` (the pipeline runtime does it for the
last ``B``/``W``/``BW`` action of each stage in its action list; a plain loop wraps the backward of
its last microbatch). Inside that block, the first grad a param receives makes it *ready* (the
usual case: one grad per param per backward pass; a param that declares ``meta.grad_uses = n``, see
below, at its n-th); when the block ends every param of the chunk is ready, including params
that received no grad at all this step. A bucket's reduction starts
(an async work handle) once all its params are ready. Params that get no grad in some steps, get
grads only from a later step on, or get a different number of grads per step therefore need no
special handling. Without any :meth:`last_backward` block (or with ``overlap_grad_reduce=False``)
every bucket is reduced in :meth:`finish_grad_sync`.

The one thing the block cannot see: a param that receives a *second* grad inside the last
backward pass of its chunk (a linear module applied twice in one forward) after its bucket was
launched. That raises, naming the param, rather than reducing a partial sum. A param whose module
is applied a known ``n`` times per forward declares it as ``param.meta.grad_uses = n`` (default 1): it
becomes ready at its ``n``-th grad inside the block (the MoE layer does so for its experts under
the chunked dispatcher, which runs them once per token chunk). Declaring more uses than happen
only delays the param to the end of the block.

Buckets of a buffer are launched strictly in index order, so every rank issues the same
collectives in the same order whatever the timing of its backward. Expert buffers (reduced over
``ctx.expert_dp``) follow the same rule as dense ones: every local expert produces a grad event in
every backward pass, zero for an expert that got no tokens
(:class:`~paratron.models.moe.experts.LocalExperts`), so the sequence of grad events, and with it
the launch order, is the same on every rank of the expert-DP group. Where that group has the same
ranks as the dense DP group the two share one communicator, which the same argument keeps in step.
Tied-embedding and sequence-parallel params sit in deferred buckets, launched by
:meth:`finish_grad_sync` after their model-parallel all-reduce (:mod:`paratron.optim.finalize`).

Reduction is a plain SUM over the DP group: the training step divides the loss by the global
number of valid tokens before backward, so summed grads equal the single-device token mean.
Dense params reduce over ``ctx.dp_cp`` (``ctx.dp`` without context parallelism: CP ranks see
different tokens of the same sequences), expert params over ``ctx.expert_dp``. With
``zero=1`` (ZeRO-1, the distributed optimizer) a bucket is reduce-scattered instead of all-reduced: rank
``r`` receives the summed grads of shard ``r`` of every bucket (Rajbhandari et al. 2020, section
5.1).

A rank may hold no trainable param at all (an empty pipeline stage): it then has no buffer and
no bucket, and its DP reductions are empty.

What a bucket's reduction is, is chosen once from the ZeRO stage: a reducer of
:mod:`paratron.optim.reducers` (all-reduce buckets, reduce-scatter buckets, staged shards), to
which DDP delegates; DDP keeps the buffers and the schedule bookkeeping above.
ZeRO stages 2 and 3 (``zero=2|3``) keep no full-size grad buffer: grads are staged per bucket and
reduce-scattered during backward by :class:`~paratron.optim.zero.ShardedGrads` whenever every
param of a bucket has a grad (a rule that needs no last-backward block), which also holds the
ZeRO-1 shards, so all three stages share one set of shard buffers. Stage 3 also shards the
params (:class:`~paratron.optim.param_gather.ParamShards`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from paratron.parallel.context import ParallelContext
from paratron.parallel.params import is_marked, unique_params

from .grad_buffer import Bucket, GradBuffer
from .reducers import reducer_class


def chunk_params(chunks) -> list[nn.Parameter]:
    """Unique trainable params of ``chunks`` (a module or a list of modules), in registration
    order (a tied param shared by two chunks appears once)."""
    return unique_params(chunks, trainable_only=True)


def _needs_model_parallel_reduction(p) -> bool:
    return p.meta.shared_embedding or p.meta.sequence_parallel


class _BucketState:
    """Per-step bookkeeping of one bucket: params not yet ready, and the reduction in flight."""

    __slots__ = ("pending", "launched", "handle", "timed")

    def __init__(self) -> None:
        self.pending = 0
        self.launched = False
        self.handle = None
        self.timed = None  # (recorder, interval) while a timeline is recorded (ledger.intervals)

    def wait(self) -> None:
        """Wait for the reduction in flight; close its recorded interval, if any."""
        self.handle.wait()
        self.handle = None
        if self.timed is not None:
            rec, iv = self.timed
            rec.waited(iv)
            self.timed = None


class DistributedDataParallel:
    """Gradient buffers, buckets and their reduction over data-parallel ranks.

    Per step: :meth:`zero_grad_buffer`; the backward passes of every microbatch, the last one
    of each chunk inside :meth:`last_backward`; then :meth:`finish_grad_sync` (through
    :func:`paratron.optim.finalize.finalize_grads`, which first runs the model-parallel
    all-reduces).

    Args:
        chunks: the model chunks (``nn.Module`` or list: one per virtual pipeline stage) of this
            rank. Every trainable param must carry :func:`paratron.parallel.params.mark`'s
            ``meta``. A chunk may have no param (an empty pipeline stage).
        ctx: the :class:`~paratron.parallel.context.ParallelContext`.
        grad_dtype: dtype of the main grads (fp32).
        bucket_size_mb: MiB of grads per bucket (in ``grad_dtype``); <= 0: one bucket.
        overlap_grad_reduce: start each bucket's reduction during the last backward as soon as it
            is ready; else reduce everything in :meth:`finish_grad_sync`.
        zero: the ZeRO stage 0-3, which picks the reducer (:mod:`paratron.optim.reducers`):
            0 all-reduces buckets; 1 (the distributed optimizer) reduce-scatters them, each DP
            rank keeping the summed grads of its shard of every bucket in :attr:`shard_grads`;
            2 and 3 stage grads per bucket, 3 also shards the params.
        zero3_reshard_after_forward: stage 3: free a unit's params after its forward.
        zero3_prefetch: stage 3: all-gather the next unit's params ahead of use.

    Raises:
        ValueError: a param was not marked (no ``meta``), or ``zero`` is not 0..3.
    """

    def __init__(self, chunks, ctx: ParallelContext, *, grad_dtype: torch.dtype = torch.float32,
                 bucket_size_mb: float = 40.0, overlap_grad_reduce: bool = True, zero: int = 0,
                 zero3_reshard_after_forward: bool = True, zero3_prefetch: bool = True) -> None:
        self.chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
        self.ctx = ctx
        self.grad_dtype = grad_dtype
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.zero = int(zero)
        reducer = reducer_class(self.zero)  # raises on a bad stage, before any buffer
        params = chunk_params(self.chunks)
        for p in params:
            if not is_marked(p):
                raise ValueError(f"a param of shape {tuple(p.shape)} has no meta: every param must "
                                 "be marked with paratron.parallel.params.mark")
        self.buffers = self._build_buffers(params, bucket_size_mb, reducer)
        self.params = params

        # The one choice per stage: what a bucket's reduction is and where the sums land.
        self.reducer = reducer(self.buffers, grad_dtype, stage=self.zero, chunks=self.chunks,
                               prefetch=zero3_prefetch, reshard_after_forward=zero3_reshard_after_forward)
        self.shard_grads = self.reducer.shard_grads
        self.param_shards = self.reducer.param_shards
        # The schedule launches buckets only for a reducer that reduces whole buckets.
        self._schedules_launches = self.overlap_grad_reduce and self.reducer.launches_buckets

        self._where = {id(p): (i, b.index) for i, buf in enumerate(self.buffers)
                       for b in buf.buckets for p in b.params}
        # The chunks that hold each param (two for a tied embedding whose ends share a rank).
        self._chunk_params = [chunk_params(c) for c in self.chunks]
        self._owners: dict[int, list[int]] = {}
        for c, ps in enumerate(self._chunk_params):
            for p in ps:
                self._owners.setdefault(id(p), []).append(c)
        self._states = [[_BucketState() for _ in buf.buckets] for buf in self.buffers]
        self._next = [0] * len(self.buffers)
        self._closing: set[int] = set()     # chunks inside their last backward
        self._closed: set[int] = set()      # chunks whose last backward is over
        self._ready: set[int] = set()       # ids of params whose grads are complete
        self._uses: dict[int, int] = {}     # grads seen inside the last backward, per param id
        self.finalized = False
        for p in params:
            p.meta.grad_ready_hook = self._grad_ready
            p.meta.acquire_main_grad = self.reducer.acquire  # None with a full grad buffer
            p.register_post_accumulate_grad_hook(self._autograd_grad_ready)
        self._reset_step()

    def _build_buffers(self, params, bucket_size_mb: float, reducer) -> list[GradBuffer]:
        bucket_numel = int(bucket_size_mb * 2**20) // torch.empty((), dtype=self.grad_dtype).element_size()
        # Reverse registration order approximates the order in which backward produces grads.
        kinds: dict[tuple[torch.dtype, bool], list] = {}
        for p in reversed(params):
            kinds.setdefault((p.dtype, p.meta.is_expert), []).append(p)
        units = reducer.bucket_units(self.chunks, params)
        return [GradBuffer.build(ps, [_needs_model_parallel_reduction(p) for p in ps],
                                 group=self.ctx.expert_dp if is_expert else self.ctx.dp_cp,
                                 is_expert=is_expert, grad_dtype=self.grad_dtype,
                                 bucket_numel=bucket_numel, units=[units.get(id(p), 0) for p in ps],
                                 allocate_grads=reducer.allocates_grads)
                for (_, is_expert), ps in kinds.items()]

    # ---- the per-step cycle ------------------------------------------------------------------
    def zero_grad_buffer(self) -> None:
        """Zero every main grad and start a new step (call before the first microbatch)."""
        self._reset_step()  # first: it waits for reductions still in flight on these buffers
        self.reducer.start_step()
        for buf in self.buffers:
            if buf.grad_data is not None:
                buf.grad_data.zero_()
        for p in self.params:
            p.grad = None

    @contextmanager
    def last_backward(self, chunk_ids=None):
        """Declare the backward pass run inside this block the last of the step for the given
        chunks (indices into ``chunks``; default: all of them).

        Inside, a param's first grad makes it ready (it may then be reduced at once); on exit,
        every param of these chunks is ready and each bucket whose params are all ready starts
        its reduction, in bucket order. (ZeRO-2/3 flush by their own rule and ignore it.)

        Raises:
            RuntimeError: a chunk's last backward was already declared this step.
        """
        ids = range(len(self.chunks)) if chunk_ids is None else list(chunk_ids)
        for c in ids:
            if c in self._closed or c in self._closing:
                raise RuntimeError(f"last_backward: chunk {c} already had its last backward this step")
        self._closing.update(ids)
        try:
            yield
        finally:
            self._closing.difference_update(ids)
            self._closed.update(ids)
        for c in ids:
            for p in self._chunk_params[c]:
                if all(o in self._closed for o in self._owners[id(p)]):
                    self._mark_ready(p)
        for i in range(len(self.buffers)):
            self._launch_ready(i)

    def start_deferred(self) -> None:
        """Launch, in order, every bucket not yet launched, including the deferred ones (call
        after the model-parallel all-reduces of tied-embedding and sequence-parallel grads)."""
        for i in range(len(self.buffers)):
            self._launch_upto(i, len(self.buffers[i].buckets))

    def finish_grad_sync(self) -> None:
        """Launch every remaining bucket (in order) and wait for all reductions; afterwards the
        main grads (all-reduce) or :attr:`shard_grads` (ZeRO) hold the sum over the DP group
        and :attr:`finalized` is True until the next :meth:`zero_grad_buffer`. A second call in
        the same step does nothing."""
        if self.finalized:
            return
        self.reducer.finish()
        if self.reducer.launches_buckets:
            self.start_deferred()
        for states in self._states:
            for st in states:
                if st.handle is not None:
                    st.wait()
        self.finalized = True

    # ---- grad events -------------------------------------------------------------------------
    def _autograd_grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        meta = p.meta
        main = meta.main_grad if meta.main_grad is not None else meta.acquire_main_grad(p)
        grad = p.grad
        if grad.is_sparse:  # an embedding lookup's rows (VocabParallelEmbedding under DDP)
            # On a GPU coalesced first: each row is added once, so the sum does not depend on the
            # order of atomic adds. On the CPU index_add_ adds in token order, as the dense
            # backward did (coalescing would reorder repeated ids and change the last bits).
            if grad.device.type != "cpu":
                grad = grad.coalesce()
            main.view(p.shape).index_add_(0, grad._indices()[0], grad._values().to(main.dtype))
        else:
            main.add_(grad.view_as(main))
        p.grad = None
        meta.grad_ready_hook(p)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self.reducer.grad_event(p):  # a staged reducer takes the event itself
            return
        i, k = self._where[id(p)]
        if self._states[i][k].launched:
            raise RuntimeError(
                f"{p.meta.logical_name} received a grad after its bucket's DP reduction started: the "
                "backward that produced it came after the one declared the last of its chunk "
                "(DistributedDataParallel.last_backward), or the param got more grads inside that "
                "last backward pass than its grad_uses (a module applied twice in one forward: "
                "declare param.meta.grad_uses, or set parallel.overlap_grad_reduce=false)")
        if self._closing and id(p) not in self._ready:
            if all(o in self._closing or o in self._closed for o in self._owners[id(p)]):
                uses = self._uses[id(p)] = self._uses.get(id(p), 0) + 1
                if uses >= p.meta.grad_uses:
                    self._mark_ready(p)
                    self._launch_ready(i)

    def _mark_ready(self, p) -> None:
        if id(p) in self._ready:
            return
        self._ready.add(id(p))
        i, k = self._where[id(p)]
        self._states[i][k].pending -= 1

    def _launch_ready(self, i: int) -> None:
        buf, states = self.buffers[i], self._states[i]
        if not self._schedules_launches:
            return
        n = self._next[i]
        while n < len(buf.buckets) and states[n].pending == 0 and not buf.buckets[n].deferred:
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
        st.handle = self.reducer.launch(i, bucket)
        st.launched = True
        rec = self.ctx.ledger.intervals
        if rec is not None and st.handle is not None:  # recorded for a step's timeline
            st.timed = rec, rec.issued("bucket_reduce", st.handle)

    def _reset_step(self) -> None:
        self._closing.clear()
        self._closed.clear()
        self._ready.clear()
        self._uses.clear()
        self.finalized = False
        for i, buf in enumerate(self.buffers):
            self._next[i] = 0
            for b in buf.buckets:
                st = self._states[i][b.index]
                if st.handle is not None:
                    st.wait()
                st.launched, st.pending = False, len(b.params)

    # ---- introspection -----------------------------------------------------------------------
    def owned_ranges(self, i: int) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, end, grads)`` for each flat range of buffer ``i`` this rank updates: the
        whole buffer without ZeRO, its shard of every bucket with ZeRO-1. ``grads`` is the
        ``[end - start]`` tensor that holds the DP-summed grads of the range after
        :meth:`finish_grad_sync`."""
        return self.reducer.owned_ranges(i)

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
        grads += self.reducer.grad_tensors()
        return {"params": params, "grads": grads}

    def num_launched(self) -> int:
        """Buckets whose reduction has started this step (for tests and logging)."""
        return self.reducer.launches
