"""Execute one pipeline rank's action list: forward, split backward (B/W), batched p2p.

The runtime is the only part of the pipeline package that touches tensors. It runs exactly the
list it is given (built by a registered schedule and checked by :mod:`.validate`), with these
rules:

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
  and the backward of another interleaved. The backward of a paired microbatch was cut at its
  layer boundaries during its forward (a chunk with a ``layer_boundary`` attribute, such as
  :class:`~paratron.models.gpt.GPTChunk`, hands the runtime each boundary activation), so it runs
  as one autograd call per segment (the head on the last stage, else the last layer, first;
  the embedding last on the first stage). The pair starts with the first segment; every module of the forward's chunk with a ``while_in_flight`` attribute (the MoE
  layers) is given a hook that its dispatcher calls after launching an all-to-all
  asynchronously: the hook runs the next backward segment, then waits for the exchange. What is
  left of either half runs after the forward returns. Both halves' collectives are issued in the
  same order on every rank of a group (the same list, the same model), so they match.
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

from ..parallel.grads import WeightGradStore
from ..parallel.intervals import IntervalRecorder
from ..parallel.profiling import labelled
from ..parallel.random import capture_default_states, restore_default_states
from .actions import (Action, batches, forward_only as strip_backward, halves, last_backward_actions, recomputed,
                      stages_of)
from .timeline import TraceEvent, event_name, from_intervals

ForwardStep = Callable[[int, nn.Module, "torch.Tensor | None", Any], torch.Tensor]


def attach_weight_grad_stores(chunks: Sequence[nn.Module]) -> list[WeightGradStore]:
    """Give every submodule of each chunk that has a ``weight_grad_store`` attribute the chunk's
    own store (one store per chunk, so W's of a chunk follow that chunk's B's); returns them."""
    stores = []
    for chunk in chunks:
        store = WeightGradStore()
        for module in chunk.modules():
            if hasattr(module, "weight_grad_store"):
                module.weight_grad_store = store
        stores.append(store)
    return stores


def run_pipeline(actions: list[Action], chunks: Sequence[nn.Module], ctx, microbatches: Sequence[Any],
                 forward_step: ForwardStep, tensor_shape: Sequence[int], dtype: torch.dtype, *,
                 forward_only: bool = False, timeline: list[TraceEvent] | None = None,
                 grad_sync=None, link_delay=None,
                 tensor_shapes: Sequence[Sequence[int]] | None = None, encoder=None) -> list[torch.Tensor]:
    """Run this rank's part of one pipelined step.

    Args:
        actions: this rank's action list (``build_schedule(...)[ctx.pp.rank]``).
        chunks: this rank's model chunks, ordered by ascending stage (local chunk ``c`` runs stage
            ``stages_of(actions)[c]``). The model has ``ctx.pp.size * len(chunks)`` stages.
        ctx: the :class:`~paratron.parallel.context.ParallelContext`; p2p goes over ``ctx.pp``.
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
        link_delay: a :class:`~paratron.pipeline.delay.LinkDelay` (tests and benchmarks, gloo):
            a message over its link is received its ``seconds`` after it was sent; None: none.
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
    stages = stages_of(actions)
    if len(stages) != len(chunks):
        raise ValueError(f"the action list runs stages {stages} but {len(chunks)} model chunks were given")
    if actions and max(a.microbatch for a in actions) >= len(microbatches):
        raise ValueError(f"the action list uses microbatch {max(a.microbatch for a in actions)} but only "
                         f"{len(microbatches)} microbatches were given")
    if tensor_shapes is not None and len(tensor_shapes) < len(microbatches):
        raise ValueError(f"tensor_shapes has {len(tensor_shapes)} entries for {len(microbatches)} microbatches")
    run = _Run(ctx, chunks, stages, ctx.pp.size * len(chunks) - 1, microbatches, forward_step,
               tuple(tensor_shape), dtype, forward_only, timeline)
    if tensor_shapes is not None:
        run.shapes = [tuple(s) for s in tensor_shapes]
    if grad_sync is not None and not forward_only:
        run.grad_sync, run.last_backward = grad_sync, last_backward_actions(actions)
    if not forward_only:
        run.again = recomputed(actions)
        run.segmented = {(h.microbatch, h.stage) for a in actions if a.kind == "FB" for h in halves(a)[1:]}
    run.link_delay = link_delay
    run.encoder = encoder
    if encoder is not None:
        encoder.forward_only = forward_only
    run.execute(strip_backward(actions) if forward_only else actions)
    return [run.losses[mb] for mb in sorted(run.losses)]


class _Run:
    """The buffers of one :func:`run_pipeline` call, keyed by (microbatch, stage)."""

    def __init__(self, ctx, chunks, stages, last, microbatches, forward_step, shape, dtype, forward_only,
                 timeline):
        self.ctx, self.chunks, self.last = ctx, chunks, last
        self.local = {s: c for c, s in enumerate(stages)}
        self.microbatches, self.forward_step = microbatches, forward_step
        self.shape, self.dtype, self.forward_only, self.timeline = shape, dtype, forward_only, timeline
        self.shapes: list[tuple[int, ...]] | None = None  # per microbatch, when they differ
        self.device = next((p.device for c in chunks for p in c.parameters()), torch.device(ctx.device))
        self.stores = [] if forward_only else attach_weight_grad_stores(chunks)
        self.received: dict[tuple[int, int], torch.Tensor] = {}   # RECV_F: input of (mb, stage)
        self.to_send: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F"|"B", mb, stage)
        self.local_out: dict[tuple[int, int], torch.Tensor] = {}  # output kept for a local next stage
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.out_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.pending_sends: list[tuple[Any, torch.Tensor]] = []
        self.prefetched: dict[int, list[tuple[Action, torch.Tensor, Any]]] = {}  # step index -> posted recvs
        self.next_p2p: dict[int, int] = {}
        self.grad_sync, self.last_backward = None, {}
        self.link_delay = None
        self.encoder = None
        self.again: set[tuple[int, int]] = set()  # (mb, stage) whose F is recomputed by an R
        self.rng_at_forward: dict[tuple[int, int], Any] = {}
        self.segmented: set[tuple[int, int]] = set()  # (mb, stage) whose backward is an FB half
        self.cuts: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pair_events: list[TraceEvent] = []
        self.tracker = next((m.rng_tracker for c in chunks for m in c.modules()
                             if getattr(m, "rng_tracker", None) is not None), None)
        # A RecordedTimeline fixes the clock's zero (a training step's start); else this call's.
        self.t0 = getattr(timeline, "origin", None) or time.perf_counter()

    def execute(self, actions: list[Action]) -> None:
        steps = batches(actions)
        p2p_at = [i for i, step in enumerate(steps) if step[0].is_p2p and not step[0].is_encoder]
        self.next_p2p = dict(zip(p2p_at, p2p_at[1:]))
        with self.recording_intervals():
            self.run_steps(steps, p2p_at)
        for work, _ in self.pending_sends:
            work.wait()
        self.pending_sends.clear()
        if self.encoder is not None:
            self.encoder.finish()
        for c, store in enumerate(self.stores):
            if len(store):
                raise RuntimeError(f"pipeline chunk {c}: {len(store)} deferred weight-grad groups are still "
                                   "queued after the schedule; every B needs a W")

    def run_steps(self, steps: list[list[Action]], p2p_at: list[int]) -> None:
        try:
            if p2p_at:
                self.prefetched[p2p_at[0]] = self.post_recvs(steps[p2p_at[0]])
            for i, step in enumerate(steps):
                start = time.perf_counter()
                if step[0].is_encoder:
                    self.encoder.run(step)
                elif step[0].is_p2p:
                    self.p2p(i, step, steps)
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

    # ---- compute ---------------------------------------------------------------------------
    def compute_recorded(self, a: Action) -> None:
        """:meth:`compute`, with the interval recorder (if any) stamped with the action's
        (microbatch, stage)."""
        rec = self.ctx.ledger.intervals if self.timeline is not None else None
        if rec is None:
            self.compute(a)
            return
        scope, rec.scope = rec.scope, (a.microbatch, a.stage)
        try:
            self.compute(a)
        finally:
            rec.scope = scope

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

    def compute(self, a: Action) -> None:
        run = getattr(self, "do_" + a.kind)
        last = sorted({self.local[h.stage] for h in halves(a) if self.last_backward.get(h.stage) == a})
        with labelled(event_name(a.kind, a.microbatch, a.stage)):  # a torch.profiler range, if profiling
            if self.grad_sync is None or not last:
                run(a)
                return
            with self.grad_sync.last_backward(last):
                run(a)

    def do_F(self, a: Action) -> None:
        key, s = (a.microbatch, a.stage), a.stage
        if s == 0:
            x = None
        elif (a.microbatch, s - 1) in self.local_out:
            x = self.local_out.pop((a.microbatch, s - 1))
        else:
            x = self.received.pop(key)
        if x is not None and not self.forward_only:
            x = x.detach().requires_grad_(True)  # a leaf: its .grad is what goes to stage s-1
        again = key in self.again
        if again:
            self.rng_at_forward[key] = self._rng_states()
        with torch.set_grad_enabled(not (self.forward_only or again)):
            out = self._forward(key, x)
        if s == self.last:
            if out.dim() != 0:
                raise ValueError(f"forward_step must return a scalar loss on the last stage; got shape "
                                 f"{tuple(out.shape)} for microbatch {a.microbatch}")
            self.losses[a.microbatch] = out.detach()
        elif s + 1 in self.local:
            self.local_out[key] = out.detach()
        else:
            self.to_send[("F",) + key] = out.detach()
        if again:
            self.inputs[key] = x
        elif not self.forward_only:
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
        with the chunk's ``layer_boundary`` cutting the graph at each boundary it reports."""
        c = self.local[key[1]]
        chunk = self.chunks[c]
        if key not in self.segmented or not hasattr(chunk, "layer_boundary"):
            return self.forward_step(c, chunk, x, self.microbatches[key[0]])
        cuts = self.cuts.setdefault(key, [])

        def cut(t: torch.Tensor) -> torch.Tensor:
            if not (torch.is_grad_enabled() and t.requires_grad and t.grad_fn is not None):
                return t
            leaf = t.detach().requires_grad_(True)  # the next segment's input; its .grad links them
            cuts.append((t, leaf))
            return leaf

        chunk.layer_boundary = cut
        try:
            return self.forward_step(c, chunk, x, self.microbatches[key[0]])
        finally:
            chunk.layer_boundary = None

    def _backward_segments(self, a: Action, split: bool):
        """The backward of ``a`` (a ``B`` or ``BW``), one autograd call per segment of its graph
        (one in all unless its forward was cut), yielding between segments; the last one also
        hands the input grad on."""
        key, s = (a.microbatch, a.stage), a.stage
        out, x = self.outputs.pop(key), self.inputs.pop(key)
        grad = None if s == self.last else self.out_grads.pop(key)
        pieces = [(out, grad)] + [(t, leaf) for t, leaf in reversed(self.cuts.pop(key, []))]
        store = self.stores[self.local[s]]
        for k, (t, g) in enumerate(pieces):
            if k:  # a cut: the grad of its leaf, summed over the later segment's uses
                g = g.grad if g.grad is not None else torch.zeros_like(g)
            store.deferring = split
            try:
                torch.autograd.backward(t, grad_tensors=g)
            finally:
                store.deferring = False
            if k + 1 < len(pieces):
                yield
        if split:
            store.mark()
        if x is not None:
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            if s - 1 in self.local:
                self.out_grads[(a.microbatch, s - 1)] = g
            else:
                self.to_send[("B",) + key] = g

    def _backward(self, a: Action, split: bool) -> None:
        for _ in self._backward_segments(a, split):
            pass

    def do_FB(self, a: Action) -> None:
        """Run an ``FB`` pair: the backward half's first segment, then the forward half, whose
        MoE dispatchers run the next backward segment while each all-to-all is in flight."""
        f, b = halves(a)
        rank, now = self.ctx.pp.rank, lambda: time.perf_counter() - self.t0
        rec = self.ctx.ledger.intervals if self.timeline is not None else None
        backward = _Segments(self._backward_segments(b, split=b.kind == "B"), rec, (b.microbatch, b.stage))
        b_start = now()
        backward.step()

        def while_in_flight(what: str, wait: Callable[[], None]) -> None:
            if backward.busy:  # a recompute inside a backward segment runs a forward: no nesting
                return
            backward.step()
            wait()

        hooked = [m for m in self.chunks[self.local[f.stage]].modules() if hasattr(m, "while_in_flight")]
        f_start = now()
        for m in hooked:
            m.while_in_flight = while_in_flight
        try:
            self.do_F(f)
        finally:
            for m in hooked:
                m.while_in_flight = None
        f_end = now()
        while not backward.done:
            backward.step()
        self.pair_events = [TraceEvent(rank, "F", f.microbatch, f.stage, f_start, f_end),
                            TraceEvent(rank, b.kind, b.microbatch, b.stage, b_start, backward.end - self.t0)]

    def do_B(self, a: Action) -> None:
        self._backward(a, split=True)

    def do_BW(self, a: Action) -> None:
        self._backward(a, split=False)

    def do_W(self, a: Action) -> None:
        self.stores[self.local[a.stage]].flush()

    # ---- p2p ---------------------------------------------------------------------------------
    def shape_of(self, microbatch: int) -> tuple[int, ...]:
        """The shape of the activations (and their grads) of ``microbatch`` sent between stages."""
        return self.shape if self.shapes is None else self.shapes[microbatch]

    def post_recvs(self, step: list[Action]) -> list[tuple[Action, torch.Tensor, Any]]:
        """Post the receives of a batch now; they are waited for when the batch is reached.

        Posting a receive early changes neither the matching (receives from one peer keep their
        list order) nor any wait, so the validator's guarantees hold; it lets the transfer run
        while this rank computes instead of after it reaches the batch.
        """
        recvs = [(a, torch.empty(self.shape_of(a.microbatch), dtype=self.dtype, device=self.device))
                 for a in step if a.kind.startswith("RECV")]
        if not recvs:
            return []
        ops, stamps = [], []
        for a, buf in recvs:
            ops.append(self.ctx.pp.p2p_op("recv", buf, a.peer))
            stamps.append(self.link_delay.stamp_buffer(self.device) if self.delayed(a.peer) else None)
            if stamps[-1] is not None:  # the injected delay's send time follows the message
                ops.append(self.ctx.pp.p2p_op("recv", stamps[-1], a.peer))
        works = iter(self.ctx.pp.batch_isend_irecv(ops))
        return [(a, buf, next(works) if stamp is None else self.link_delay.delayed(next(works), next(works), stamp))
                for (a, buf), stamp in zip(recvs, stamps)]

    def delayed(self, peer: int) -> bool:
        """The link to ``peer`` has an injected delay (:class:`~paratron.pipeline.delay.LinkDelay`)."""
        return self.link_delay is not None and self.link_delay.applies(self.ctx.pp.rank, peer)

    def p2p(self, index: int, step: list[Action], steps: list[list[Action]]) -> None:
        ops, sends = [], []
        for a in step:
            if a.kind.startswith("SEND"):
                t = self.to_send.pop((a.kind[-1], a.microbatch, a.stage)).contiguous()
                if tuple(t.shape) != self.shape_of(a.microbatch) or t.dtype != self.dtype:
                    raise ValueError(f"{a}: the tensor to send has shape {tuple(t.shape)} and dtype {t.dtype}; "
                                     f"the receiver expects tensor_shape={list(self.shape_of(a.microbatch))}, "
                                     f"dtype={self.dtype}")
                ops.append(self.ctx.pp.p2p_op("send", t, a.peer))
                sends.append(t)
                if self.delayed(a.peer):
                    sends.append(self.link_delay.stamp(self.device))
                    ops.append(self.ctx.pp.p2p_op("send", sends[-1], a.peer))
        if ops:
            for work, t in zip(self.ctx.pp.batch_isend_irecv(ops), sends):
                self.pending_sends.append((work, t))
        recvs = self.prefetched.pop(index)
        nxt = self.next_p2p.get(index)
        if nxt is not None:
            self.prefetched[nxt] = self.post_recvs(steps[nxt])
        for a, buf, work in recvs:
            work.wait()
            if a.kind == "RECV_F":
                self.received[(a.microbatch, a.stage)] = buf
            else:
                self.out_grads[(a.microbatch, a.stage)] = buf


class _Segments:
    """The backward half of an ``FB`` pair, advanced one segment per :meth:`step`; each segment
    is recorded as a ``backward`` compute interval under the backward's (microbatch, stage)."""

    def __init__(self, segments, rec, scope: tuple[int, int]):
        self.segments, self.rec, self.scope = segments, rec, scope
        self.busy = self.done = False
        self.end = 0.0  # perf_counter() when the last segment finished

    def step(self) -> None:
        if self.done:
            return
        self.busy = True
        outer = None
        if self.rec is not None:
            outer, self.rec.scope = self.rec.scope, self.scope
        try:
            if self.rec is None:
                self.done = next(self.segments, self) is self
            else:
                with self.rec.compute("backward"):
                    self.done = next(self.segments, self) is self
        finally:
            self.busy = False
            if self.rec is not None:
                self.rec.scope = outer
        self.end = time.perf_counter()
