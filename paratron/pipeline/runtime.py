"""Execute one pipeline rank's action list: forward, split backward (B/W), batched p2p.

The runtime is the only part of the pipeline package that touches tensors. It runs exactly the
list it is given (built by a registered schedule and checked by :mod:`.validate`), as planned
once by :func:`~paratron.pipeline.plan.plan_run`, on chunks seen through
:class:`~paratron.pipeline.chunk.PipelineChunk`, with these rules:

* Each maximal run of send/recv actions is one batch (``ctx.pp.batch_isend_irecv``) of ops built by
  ``ctx.pp.p2p_op`` (so the comm ledger counts them). The rank waits for the batch's receives when
  it reaches the batch and for its sends at the end of the schedule (sends never block, as the
  validator assumes). A batch's receives are posted one batch ahead, when the previous batch is
  reached, so that their transfers overlap the compute in between.
* ``B`` runs autograd with the chunk's :class:`~paratron.parallel.grads.WeightGradStore` deferring:
  linear layers queue their weight grads (Qi et al. 2023, section 2) while everything else
  (norms, embeddings, biases outside linears) gets its grad at once; ``W`` flushes the oldest
  queued group of the chunk. ``BW`` is a plain backward. Every store must be empty at the end.
* Grads accumulate across microbatches in ``.grad`` / ``main_grad``. The runtime never rescales:
  ``forward_step`` returns a loss already divided by the global token count, and the runtime
  backpropagates it with grad 1.
* Stages on the same rank pass activations and grads locally, without p2p.
* Shapes: every activation (and its grad) has ``tensor_shape``, or with ``tensor_shapes`` the
  shape of its microbatch (variable-length microbatches, :mod:`paratron.data.token_batches`).
  A receiver sizes its buffer from the microbatch index of the action: every stage of a pipeline
  holds the same microbatches, so no shape header travels and fixed-shape runs send nothing more.
* Recompute: when the list has an ``R(mb, s)``, ``F(mb, s)`` runs without autograd and keeps
  only its input and the RNG states it started from; ``R`` restores those states (so dropout
  draws the same masks), runs the forward again with autograd and keeps the graph for the
  backward, then puts the RNG states back. Where the ``R`` sits in the list is the schedule's
  choice (:mod:`.recompute_placement`).
* Cross-microbatch overlap (:mod:`.overlap`): an ``FB`` pair runs the forward of one microbatch
  and the backward of another interleaved (:mod:`.fb_pair`): the backward in layer segments,
  one while each all-to-all of the forward is in flight.
* Gradient finalisation is driven by the list: the last backward action (``B``, ``W`` or ``BW``)
  of each stage is the last one that produces grads for that chunk in this step, so the runtime
  runs it inside ``grad_sync.last_backward([chunk])`` when a ``grad_sync`` (the
  :class:`~paratron.optim.ddp.DistributedDataParallel` of the chunks) is given. DDP then starts
  each bucket's reduction as soon as it is complete, with no grad counting.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..parallel.intervals import IntervalRecorder
from ..parallel.profiling import labelled
from ..parallel.random import capture_default_states, restore_default_states
from .actions import Action, halves
from .chunk import as_pipeline_chunk, attach_weight_grad_stores
from .fb_pair import LayerCuts, leaf_grad, run_fb_pair
from .plan import RunPlan, plan_run
from .timeline import TraceEvent, event_name, from_intervals

ForwardStep = Callable[[int, nn.Module, "torch.Tensor | None", Any], torch.Tensor]


def run_pipeline(actions: list[Action], chunks: Sequence[nn.Module], ctx, microbatches: Sequence[Any],
                 forward_step: ForwardStep, tensor_shape: Sequence[int], dtype: torch.dtype, *,
                 forward_only: bool = False, timeline: list[TraceEvent] | None = None,
                 grad_sync=None, tensor_shapes: Sequence[Sequence[int]] | None = None,
                 encoder=None) -> list[torch.Tensor]:
    """Run this rank's part of one pipelined step.

    Args:
        actions: this rank's action list (``build_schedule(...)[ctx.pp.rank]``).
        chunks: this rank's model chunks, ordered by ascending stage (local chunk ``c`` runs stage
            ``stages_of(actions)[c]``). The model has ``ctx.pp.size * len(chunks)`` stages. A chunk
            implementing :class:`~paratron.pipeline.chunk.PipelineChunk` (``GPTChunk``) can run
            the backward half of an ``FB`` pair in segments; any other module runs it whole.
        ctx: the :class:`~paratron.parallel.context.ParallelContext`; p2p goes over ``ctx.pp``
            (tests inject a link latency with :meth:`~paratron.pipeline.delay.LinkDelay.over`).
        microbatches: ``microbatches[i]`` is handed to ``forward_step`` for microbatch ``i``.
        forward_step: ``(chunk_id, chunk_module, input, microbatch) -> Tensor``. ``chunk_id`` is the
            local chunk index. ``input`` is None on stage 0 (read the tokens from the microbatch),
            else the activation ``[s, b, h]`` of the previous stage. On the last stage it returns the
            scalar loss, already normalised by the caller; elsewhere the activation to pass on, of
            shape ``tensor_shape``.
        tensor_shape: shape of every activation and grad sent between stages, e.g. ``[s, b, h]``
            (``[s/tp, b, h]`` under sequence parallelism).
        dtype: their dtype.
        tensor_shapes: per microbatch, the shape of its activations and grads (variable-length
            microbatches, e.g. token-balanced packed rows), overriding ``tensor_shape``. Every
            rank computes them from the microbatches it holds (all stages of a pipeline hold the
            same microbatches), so a receiver sizes its buffer without a header message; None:
            every microbatch has ``tensor_shape``.
        forward_only: evaluation: run the forwards without autograd, skip backward and grad sends.
        timeline: if given, one :class:`TraceEvent` per action is appended (seconds since the
            start of this call; p2p actions span their batch), for comparison with the plan,
            followed by the intervals the action recorded (lanes ``compute``/``comm``, e.g. the
            MoE dispatcher's all-to-alls and expert compute; :mod:`paratron.parallel.intervals`).
            An ``FB`` pair appends its halves instead (``F`` and ``B``/``BW``, each from its
            first to its last piece, so they overlap); its intervals carry the microbatch of
            the half that ran them, and each backward segment is a ``backward`` interval.
        grad_sync: an object with a ``last_backward(chunk_ids)`` context manager (DDP), told
            which backward is the last of each local chunk; None: nobody is told (grads are then
            reduced when the caller finalizes them).
        encoder: an :class:`~paratron.pipeline.encoder_runtime.EncoderRun` that runs the list's
            encoder steps (:mod:`.encoder_schedule`); None: the list has none.

    Returns:
        On the rank holding the last stage, the detached losses in microbatch order; else ``[]``.

    Raises:
        ValueError: the chunk count does not match the list's stages, a microbatch index is out of
            range, a last-stage output is not a scalar, or an activation to send has another shape
            than its ``tensor_shape`` / ``tensor_shapes`` entry (checked before sending: a wrong
            shape would hang the receiver), or ``tensor_shapes`` has too few entries.
        RuntimeError: weight grads are still deferred at the end (a list missing W actions).
    """
    plan = plan_run(actions, len(chunks), ctx.pp.size, len(microbatches), forward_only=forward_only)
    if tensor_shapes is not None and len(tensor_shapes) < len(microbatches):
        raise ValueError(f"tensor_shapes has {len(tensor_shapes)} entries for {len(microbatches)} microbatches")
    device = next((p.device for c in chunks for p in c.parameters()), torch.device(ctx.device))
    shapes = (tuple(tensor_shape),) * len(microbatches) if tensor_shapes is None else \
        tuple(tuple(s) for s in tensor_shapes)
    links = _Links(ctx.pp, plan, shapes, dtype, device)
    run = _Run(ctx, chunks, plan, links, microbatches, forward_step, timeline,
               None if forward_only else grad_sync)
    run.encoder = encoder
    if encoder is not None:
        encoder.forward_only = forward_only
    run.execute()
    return [run.losses[mb] for mb in sorted(run.losses)]


class _Run:
    """The compute of one :func:`run_pipeline` call and its buffers, keyed by (microbatch, stage)."""

    def __init__(self, ctx, chunks: Sequence[nn.Module], plan: RunPlan, links: "_Links",
                 microbatches: Sequence[Any], forward_step: ForwardStep, timeline, grad_sync):
        self.ctx, self.chunks, self.plan, self.links = ctx, chunks, plan, links
        self.views = [as_pipeline_chunk(c) for c in chunks]
        self.microbatches, self.forward_step = microbatches, forward_step
        self.timeline, self.grad_sync = timeline, grad_sync
        self.encoder = None  # the EncoderRun of the list's encoder steps, if any
        self.stores = [] if plan.forward_only else attach_weight_grad_stores(chunks)
        self.local_out: dict[tuple[int, int], torch.Tensor] = {}  # output kept for a local next stage
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.rng_at_forward: dict[tuple[int, int], Any] = {}
        self.cuts = LayerCuts()
        self.pair_events: list[TraceEvent] = []
        self.tracker = next((v.rng_tracker for v in self.views if v.rng_tracker is not None), None)
        # A RecordedTimeline fixes the clock's zero (a training step's start); else this call's.
        self.t0 = getattr(timeline, "origin", None) or time.perf_counter()

    def execute(self) -> None:
        with self.recording_intervals():
            self.run_steps()
        self.links.wait_sends()
        if self.encoder is not None:
            self.encoder.finish()
        for c, store in enumerate(self.stores):
            if len(store):
                raise RuntimeError(f"pipeline chunk {c}: {len(store)} deferred weight-grad groups are still "
                                   "queued after the schedule; every B needs a W")

    def run_steps(self) -> None:
        try:
            self.links.start()
            for i, step in enumerate(self.plan.steps):
                start = time.perf_counter()
                if step[0].is_encoder:
                    self.encoder.run(step)
                elif step[0].is_p2p:
                    self.links.exchange(i, step)
                else:
                    self.compute_recorded(step[0])
                if self.timeline is not None and step[0].kind == "FB":
                    self.timeline.extend(self.pair_events)
                elif self.timeline is not None:
                    end = time.perf_counter() - self.t0
                    self.timeline.extend(TraceEvent(self.ctx.pp.rank, a.kind, a.microbatch, a.stage,
                                                    start - self.t0, end) for a in step)
                self.pair_events = []
        finally:
            for store in self.stores:
                store.deferring = False

    # ---- recording -------------------------------------------------------------------------
    def compute_recorded(self, a: Action) -> None:
        """:meth:`compute`, with the interval recorder (if any) stamped with the action's
        (microbatch, stage)."""
        rec = self.recorder()
        if rec is None:
            self.compute(a)
            return
        scope, rec.scope = rec.scope, (a.microbatch, a.stage)
        try:
            self.compute(a)
        finally:
            rec.scope = scope

    def recorder(self) -> IntervalRecorder | None:
        return self.ctx.ledger.intervals if self.timeline is not None else None

    @contextmanager
    def recording_intervals(self):
        """While recording a timeline: an interval recorder on the comm ledger (the caller's, if
        one is installed) for the whole run; what was recorded in it during the run is appended
        to the timeline at the end (lanes ``compute``/``comm``), so an op issued by one action
        and waited for by a later one is complete."""
        ledger = self.ctx.ledger
        if self.timeline is None:
            yield
            return
        own = ledger.intervals is None
        if own:
            ledger.intervals = IntervalRecorder()
        rec, first = ledger.intervals, len(ledger.intervals.intervals)
        try:
            yield
        finally:
            if own:
                ledger.intervals = None
        self.timeline.extend(from_intervals(rec.intervals[first:], self.ctx.pp.rank, self.t0))

    # ---- compute ---------------------------------------------------------------------------
    def compute(self, a: Action) -> None:
        run = getattr(self, "do_" + a.kind)
        last = self.plan.is_last_backward(a)
        with labelled(event_name(a.kind, a.microbatch, a.stage)):  # a torch.profiler range, if profiling
            if self.grad_sync is None or not last:
                run(a)
                return
            with self.grad_sync.last_backward(last):
                run(a)

    def do_F(self, a: Action) -> None:
        key, s, plan = (a.microbatch, a.stage), a.stage, self.plan
        if s == 0:
            x = None
        elif (a.microbatch, s - 1) in self.local_out:
            x = self.local_out.pop((a.microbatch, s - 1))
        else:
            x = self.links.received.pop(key)
        if x is not None and not plan.forward_only:
            x = x.detach().requires_grad_(True)  # a leaf: its .grad is what goes to stage s-1
        again = key in plan.recomputed
        if again:
            self.rng_at_forward[key] = self._rng_states()
        with torch.set_grad_enabled(not (plan.forward_only or again)):
            out = self._forward(key, x)
        if s == plan.last_stage:
            if out.dim() != 0:
                raise ValueError(f"forward_step must return a scalar loss on the last stage; got shape "
                                 f"{tuple(out.shape)} for microbatch {a.microbatch}")
            self.losses[a.microbatch] = out.detach()
        elif s + 1 in plan.local:
            self.local_out[key] = out.detach()
        else:
            self.links.to_send[("F",) + key] = out.detach()
        if again:
            self.inputs[key] = x
        elif not plan.forward_only:
            self.inputs[key], self.outputs[key] = x, out

    def do_R(self, a: Action) -> None:
        key = (a.microbatch, a.stage)
        now = self._rng_states()
        self._set_rng_states(self.rng_at_forward.pop(key))
        try:
            with torch.enable_grad():
                out = self._forward(key, self.inputs[key])
        finally:
            self._set_rng_states(now)
        self.outputs[key] = out

    def _rng_states(self):
        return self.tracker.get_states() if self.tracker is not None else capture_default_states()

    def _set_rng_states(self, states) -> None:
        if self.tracker is not None:
            self.tracker.set_states(states)
        else:
            restore_default_states(states)

    def _forward(self, key: tuple[int, int], x):
        """``forward_step`` of (microbatch, stage); for a microbatch whose backward is an FB half,
        with the graph cut at each layer boundary (:class:`~paratron.pipeline.fb_pair.LayerCuts`)."""
        c = self.plan.local[key[1]]
        if key not in self.plan.segmented:
            return self.forward_step(c, self.chunks[c], x, self.microbatches[key[0]])
        with self.views[c].layer_boundaries(self.cuts.cut_for(key)):
            return self.forward_step(c, self.chunks[c], x, self.microbatches[key[0]])

    def _backward_segments(self, a: Action, split: bool):
        """The backward of ``a`` (a ``B`` or ``BW``), one autograd call per segment of its graph
        (one in all unless its forward was cut), yielding between segments; the last one also
        hands the input grad on."""
        key, s, plan = (a.microbatch, a.stage), a.stage, self.plan
        out, x = self.outputs.pop(key), self.inputs.pop(key)
        grad = None if s == plan.last_stage else self.links.out_grads.pop(key)
        pieces = self.cuts.pieces(key, out, grad)
        store = self.stores[plan.local[s]]
        for k, (t, g) in enumerate(pieces):
            store.deferring = split
            try:
                torch.autograd.backward(t, grad_tensors=leaf_grad(g) if k else g)
            finally:
                store.deferring = False
            if k + 1 < len(pieces):
                yield
        if split:
            store.mark()
        if x is not None:
            g = leaf_grad(x)
            if s - 1 in plan.local:
                self.links.out_grads[(a.microbatch, s - 1)] = g
            else:
                self.links.to_send[("B",) + key] = g

    def _backward(self, a: Action, split: bool) -> None:
        for _ in self._backward_segments(a, split):
            pass

    def do_FB(self, a: Action) -> None:
        """Run an ``FB`` pair (:func:`~paratron.pipeline.fb_pair.run_fb_pair`)."""
        f, b = halves(a)
        times = run_fb_pair(f, b, self.views[self.plan.local[f.stage]], self.do_F,
                            self._backward_segments(b, split=b.kind == "B"), self.recorder())
        f_start, f_end, b_start, b_end = (t - self.t0 for t in times)
        rank = self.ctx.pp.rank
        self.pair_events = [TraceEvent(rank, "F", f.microbatch, f.stage, f_start, f_end),
                            TraceEvent(rank, b.kind, b.microbatch, b.stage, b_start, b_end)]

    def do_B(self, a: Action) -> None:
        self._backward(a, split=True)

    def do_BW(self, a: Action) -> None:
        self._backward(a, split=False)

    def do_W(self, a: Action) -> None:
        self.stores[self.plan.local[a.stage]].flush()


class _Links:
    """The p2p side of one :func:`run_pipeline` call: tensors to send, receives posted one batch
    ahead, what arrived, and the sends waited for at the end."""

    def __init__(self, group, plan: RunPlan, shapes: tuple[tuple[int, ...], ...], dtype: torch.dtype,
                 device: torch.device):
        self.group, self.plan, self.shapes, self.dtype, self.device = group, plan, shapes, dtype, device
        self.to_send: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F"|"B", mb, stage)
        self.received: dict[tuple[int, int], torch.Tensor] = {}   # RECV_F: input of (mb, stage)
        self.out_grads: dict[tuple[int, int], torch.Tensor] = {}  # grad of the output of (mb, stage)
        self.pending_sends: list[tuple[Any, torch.Tensor]] = []
        self.prefetched: dict[int, list[tuple[Action, torch.Tensor, Any]]] = {}  # step index -> posted recvs

    def start(self) -> None:
        """Post the first batch's receives, before the first step."""
        first = self.plan.first_p2p
        if first is not None:
            self.prefetched[first] = self.post_recvs(self.plan.steps[first])

    def post_recvs(self, step: Sequence[Action]) -> list[tuple[Action, torch.Tensor, Any]]:
        """Post the receives of a batch now; they are waited for when the batch is reached.

        Posting a receive early changes neither the matching (receives from one peer keep their
        list order) nor any wait, so the validator's guarantees hold; it lets the transfer run
        while this rank computes instead of after it reaches the batch.
        """
        recvs = [(a, torch.empty(self.shapes[a.microbatch], dtype=self.dtype, device=self.device))
                 for a in step if a.kind.startswith("RECV")]
        if not recvs:
            return []
        works = self.group.batch_isend_irecv([self.group.p2p_op("recv", buf, a.peer) for a, buf in recvs])
        return [(a, buf, work) for (a, buf), work in zip(recvs, works)]

    def exchange(self, index: int, step: Sequence[Action]) -> None:
        """The p2p batch at step ``index``: post its sends, post the next batch's receives, then
        wait for this batch's receives and file what arrived."""
        ops, sends = [], []
        for a in step:
            if a.kind.startswith("SEND"):
                t = self.to_send.pop((a.kind[-1], a.microbatch, a.stage)).contiguous()
                want = self.shapes[a.microbatch]
                if tuple(t.shape) != want or t.dtype != self.dtype:
                    raise ValueError(f"{a}: the tensor to send has shape {tuple(t.shape)} and dtype {t.dtype}; "
                                     f"the receiver expects tensor_shape={list(want)}, dtype={self.dtype}")
                ops.append(self.group.p2p_op("send", t, a.peer))
                sends.append(t)
        if ops:
            self.pending_sends.extend(zip(self.group.batch_isend_irecv(ops), sends))
        recvs = self.prefetched.pop(index)
        nxt = self.plan.next_p2p.get(index)
        if nxt is not None:
            self.prefetched[nxt] = self.post_recvs(self.plan.steps[nxt])
        for a, buf, work in recvs:
            work.wait()
            if a.kind == "RECV_F":
                self.received[(a.microbatch, a.stage)] = buf
            else:
                self.out_grads[(a.microbatch, a.stage)] = buf

    def wait_sends(self) -> None:
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()
