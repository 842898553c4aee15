"""Fail-slow detection and mitigation, as a training-loop plugin (Greyhound, Wu et al., ATC'25).

A fail-slow rank still works, only slower, and every collective makes its peers wait for it. The
plugin is built on public extension points only: the :class:`~paratron.training.callbacks.Callback`
hooks, module hooks on the model chunks, and :attr:`TrainState.dp_microbatches` (the one
extension point added for it: a callback may split the next global batch unevenly over DP).

Enable it with ``train.callbacks = ["paratron.plugins.failslow:FailSlow"]`` (detection and
mitigation) or ``"paratron.plugins.failslow:FailSlowDetector"`` (detection only).

**Detect.** Each rank measures its compute seconds per step (:class:`ComputeClock`: from each
chunk's forward start to its end, and from the first grad of a chunk's output to the last
parameter grad accumulated in that backward), the transformer layers' part of it, and its wait,
``forward_backward - compute`` (the rest of the step's device work: collectives and p2p). Once a
step, one host all-reduce of ``[world, 5 + 2v]`` floats shares them (:data:`HEAD`). A rank's
load is the layers' part of its compute per microbatch (the shortest forward plus the shortest
backward of the step, per chunk, which load from other processes cannot inflate) per
transformer layer of its pipeline stage: its speed, without the embedding or head its stage
holds. Its peers are the ranks of the same pipeline stage (over DP, TP, CP), or with ``DP = 1``
every other stage. A rank is flagged when its best load of the last ``window`` steps exceeds
``threshold x`` the median of its peers' best: one ``[failslow]`` line, and a ``failslow``
entry in that step's ``metrics.jsonl`` record naming the rank, its coordinates and the
slowdown. The flag is cleared after ``window`` consecutive steps below the threshold.

**Mitigate over DP** (:class:`FailSlow`). While a rank is flagged, each DP replica's speed is
the slowest of its ranks (compute per microbatch, median of the last ``window`` steps), and the
next steps' microbatches are split over the replicas to minimise the slowest one's time
(:func:`balance_microbatches`). The global batch, its samples and the global token-mean loss are
unchanged: only which replica computes which microbatch moves (the sum order of the grads does).

**Mitigate over PP.** When the flagged rank's pipeline has more than one stage, the plugin
proposes a ``parallel.pipeline_layout`` that moves layers off the slow stage, chosen with the
pipeline simulator (:func:`~paratron.plugins.failslow_layout.propose_layout`) from the measured
costs: seconds per layer per microbatch of each stage and the non-layer seconds (embedding, head,
loss) of each virtual stage, medians of the median spans over the layout's last ``2 x window``
steps; a flag raised or cleared keeps only the ``window`` steps that did it (the steps before
are of another state: healthy, or the process's warm-up). The predicted step is the measured one minus the simulated saving (what the simulator
does not model, the optimizer, the data, the p2p latency, stays). Without
``train.failslow_relayout`` the proposal is logged to be set at the next restart.

**Level 3: re-lay out online** (``train.failslow_relayout = true``, which needs
``train.elastic_relayout = true``). Each step with a full window of the present layout's
measurements, the target is the simulator's best layout while a rank is flagged other than those
of the stages the present layout took layers off, or the starting layout once none of those is
flagged (the ranks the layers moved for, not whatever flag the host's load raised then). A
target predicted to save at least ``min_gain`` of the step is proposed: a ``proposed`` line
and a ``failslow_layout`` record. The budget rents for that proposal; a later, different best
layout replaces it only when it beats it by ``repropose_gain`` of the step, with a new line and
record saying what it replaces and why (the rent paid stays: it was lost at the present layout;
it starts over only for a remedy of another reason), so the layout applied is always the one
the last ``proposed`` line named. A move away needs a full ``2 x window`` of steps since the
flag, the flagged rank over the threshold at this step (the flag outlives a slowdown by
``window`` steps), and the last ``window`` steps alone predicting the same step within
``min_gain / 2`` (:meth:`FailSlow.steady`). A ski-rental budget
(:class:`~paratron.plugins.failslow_escalate.SkiRental`) adds up the seconds lost per step;
once they reach the cost of a re-layout (``train.failslow_relayout_cost_s`` before one was
measured, then the measured one) and the gain over the remaining steps exceeds it, the plugin
asks for the layout through ``state.request_relayout`` (docs/elastic.md). A slow-rank move may
not give layers back (:func:`~paratron.plugins.failslow_escalate.moves_back`); the one way back
is the return to the start, after which the flags start afresh and a new slow-rank move rents
twice as long per return so far (a loaded host's false flag cannot send the run to and fro). Each decision is a ``failslow_decision`` record (measured and
predicted step, the costs and simulated steps they came from, gain, cost, rent paid, the
proposal's iteration), and ``window`` steps after a re-layout a ``failslow_effect`` record gives
the measured step against the prediction and the measured cost.

**Level 4: checkpoint and restart** (``train.failslow_restart = true``, which needs
``checkpoint.save``). After a level-3 re-layout, while the slow rank stays flagged, each step
rents the gap between the measured step and the simulator's step for a healthy rank at the
starting layout; when the budget reaches ``train.failslow_restart_cost_s`` (and the gap over
the remaining steps exceeds it), rank 0 writes ``RUN_DIR/restart_request.json`` (slow rank: of the ranks the re-layout was
for and slow at this step, the one whose own per-layer compute is the most over its peers',
host, checkpoint directory, prediction) and the job saves and exits with
:data:`~paratron.plugins.failslow_escalate.EXIT_FAILSLOW_RESTART`; ``paratron train
--auto-restart N`` restarts it (:mod:`paratron.launch.auto_restart`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratron.pipeline.partition import chunk_stages, stage_sizes
from paratron.pipeline.registry import get_schedule
from paratron.plugins.failslow_escalate import (EXIT_FAILSLOW_RESTART, SkiRental, moves_back, relayout_decision,
                                                relayout_effect, restart_decision, this_host,
                                                write_restart_request)
from paratron.plugins.failslow_layout import predicted_step, propose_layout, simulated_step
from paratron.training.callbacks import Callback, TrainState

__all__ = ["ComputeClock", "ClockReading", "FailSlowDetector", "FailSlow", "balance_microbatches",
           "chunk_layers", "propose_layout", "simulated_step"]

HEAD = 5
"""Leading fields of a rank's row in the per-step all-reduce: compute per microbatch (shortest
spans), compute, wait, step, and the transformer layers' part of the compute per microbatch;
then two per local chunk: its layer and its non-layer compute per microbatch (median spans)."""


def chunk_layers(chunk: nn.Module) -> list[nn.Module]:
    """The transformer layers of a model chunk (``GPTChunk.layers``), in order; [] if it has none."""
    layers = getattr(chunk, "layers", None)
    if isinstance(layers, nn.ModuleDict):
        return list(layers.values())
    return list(layers) if layers is not None else []


@dataclass
class ClockReading:
    """One step of :class:`ComputeClock`: ``compute`` seconds; ``per_mb``, the shortest forward
    plus the shortest backward of each chunk, summed (seconds); ``layer_per_mb``, the transformer
    layers' part of it; ``chunks``, per local chunk ``(median forward + median backward seconds,
    share of them in its layers)``."""

    compute: float
    per_mb: float
    layer_per_mb: float
    chunks: list[tuple[float, float]]


class ComputeClock:
    """This rank's compute seconds, from hooks on the model chunks (no device sync: on a GPU the
    host times are launch times; the detector is meant for host-bound or synchronous work and
    for the CPU).

    Forward: a chunk's forward pre-hook to its forward hook. Backward: from the hook on the
    chunk's output grad (the start of that chunk's backward) to the last parameter's
    post-accumulate-grad hook before the next forward or backward starts. Collectives inside a
    chunk (TP, ZeRO-3 gathers) count as compute; the pipeline's p2p and DP's grad sync do not.
    The transformer layers' part is timed too: in the forward, each layer's pre-hook to its hook;
    in the backward, from the grad of the last layer's output to the grad of the first layer's
    input (or the last parameter grad, when that input needs none). Their share of the chunk's
    compute splits a stage's cost into per-layer and fixed (embedding, head, loss) parts.
    """

    def __init__(self, chunks) -> None:
        self.n = len(chunks)
        # (chunk, kind) -> seconds: "F", "B" the chunk's forward and backward; "L", "LB" its
        # layers' part of them (from the first layer's input to the last layer's output)
        self.spans: dict[tuple[int, str], list[float]] = {}
        self._fwd_start: float | None = None
        self._layer_start: float | None = None
        self._layers_s = 0.0  # the open forward's layer seconds so far
        self._first_in = True  # the open forward has not entered a layer yet
        self._last_out = None  # the open forward's last layer output
        self._bwd: tuple[int, float] | None = None  # (chunk index, start) of the open backward
        self._layers_bwd: tuple[int, float] | None = None  # the same, of its layers' part
        self._last_grad = 0.0
        self.handles = []
        for i, chunk in enumerate(chunks):
            self.handles.append(chunk.register_forward_pre_hook(self._forward_begins))
            self.handles.append(chunk.register_forward_hook(self._forward_ends(i)))
            for layer in chunk_layers(chunk):
                self.handles.append(layer.register_forward_pre_hook(self._layer_begins))
                self.handles.append(layer.register_forward_hook(self._layer_ends))
            for p in chunk.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    def _forward_begins(self, module, args) -> None:
        self._close_backward()
        self._layers_s, self._first_in, self._last_out = 0.0, True, None
        self._fwd_start = time.perf_counter()

    def _forward_ends(self, i: int):
        def hook(module, args, out) -> None:
            if self._fwd_start is not None:
                self.spans.setdefault((i, "F"), []).append(time.perf_counter() - self._fwd_start)
                self.spans.setdefault((i, "L"), []).append(self._layers_s)
                self._fwd_start = None
            # The chunk's hook first: ``out`` may be the last layer's output itself.
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self._backward_begins(i))
            last, self._last_out = self._last_out, None
            if isinstance(last, torch.Tensor) and last.requires_grad:  # the layers' backward starts
                last.register_hook(lambda grad: self._layers_backward_begins(i))

        return hook

    def _layer_begins(self, module, args) -> None:
        if self._fwd_start is None:  # a recompute inside a backward
            return
        x = args[0] if args else None
        if self._first_in and isinstance(x, torch.Tensor) and x.requires_grad:  # the layers' backward ends
            x.register_hook(lambda grad: self._layers_backward_ends())
        self._first_in = False
        self._layer_start = time.perf_counter()

    def _layer_ends(self, module, args, out) -> None:
        if self._layer_start is not None:
            self._layers_s += time.perf_counter() - self._layer_start
            self._layer_start, self._last_out = None, out

    def _backward_begins(self, i: int) -> None:
        self._close_backward()
        self._last_grad = time.perf_counter()
        self._bwd = (i, self._last_grad)

    def _layers_backward_begins(self, i: int) -> None:
        self._layers_bwd = (i, time.perf_counter())

    def _layers_backward_ends(self, end: float | None = None) -> None:
        if self._layers_bwd is not None:
            i, start = self._layers_bwd
            self.spans.setdefault((i, "LB"), []).append(max(0.0, (end or time.perf_counter()) - start))
            self._layers_bwd = None

    def _grad_done(self, param) -> None:
        self._last_grad = time.perf_counter()

    def _close_backward(self) -> None:
        self._layers_backward_ends(self._last_grad)  # a first layer whose input needs no grad
        if self._bwd is not None:
            i, start = self._bwd
            self.spans.setdefault((i, "B"), []).append(max(0.0, self._last_grad - start))
            self._bwd = None

    def take(self) -> ClockReading:
        """The reading since the last call, and restart.

        Per microbatch: the sum over chunks and directions of the *shortest* span. On a shared
        host, preemption only ever adds time, so the minimum is the rank's speed; a rank that is
        slow for good is slow in every span (Greyhound's fail-slow is sustained).
        """
        self._close_backward()
        chunks, per_mb, layer_per_mb = [], 0.0, 0.0
        for i in range(self.n):
            fwd, bwd = self.spans.get((i, "F"), []), self.spans.get((i, "B"), [])
            layers = sum(self.spans.get((i, "L"), [])) + sum(self.spans.get((i, "LB"), []))
            share = min(1.0, layers / (sum(fwd) + sum(bwd))) if sum(fwd) + sum(bwd) > 0 else 0.0
            chunks.append(((statistics.median(fwd) if fwd else 0.0) + (statistics.median(bwd) if bwd else 0.0),
                           share))
            shortest = (min(fwd) if fwd else 0.0) + (min(bwd) if bwd else 0.0)
            per_mb += shortest
            layer_per_mb += shortest * share
        compute = sum(sum(v) for k, v in self.spans.items() if k[1] in ("F", "B"))
        self.spans = {}
        return ClockReading(compute, per_mb, layer_per_mb, chunks)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def balance_microbatches(seconds_per_microbatch: list[float], total: int,
                         feasible=lambda m: m >= 1) -> list[int] | None:
    """Microbatches per DP replica summing to ``total`` that minimise the slowest replica's time
    ``max_d n_d * t_d`` (greedy: each next microbatch goes where it ends first; optimal for this
    objective). Every count must satisfy ``feasible`` (e.g. the pipeline schedule's rule);
    returns None when the greedy split breaks it.
    """
    n = [1] * len(seconds_per_microbatch)
    for _ in range(total - len(n)):
        d = min(range(len(n)), key=lambda i: ((n[i] + 1) * seconds_per_microbatch[i], i))
        n[d] += 1
    return n if all(feasible(x) for x in n) else None


class FailSlowDetector(Callback):
    """Detection only (see the module docstring). Class attributes tune it: ``threshold`` (k),
    ``window`` (W consecutive steps)."""

    threshold = 1.3
    window = 3
    mitigate = False

    def __init__(self, state: TrainState) -> None:
        cfg, ctx = state.config, state.ctx
        p = cfg.parallel
        self.clock = ComputeClock(state.chunks)
        self.par, self.pp_size, self.dp_size = p, ctx.pp.size, ctx.dp.size
        self.sizes = stage_sizes(cfg.model.num_layers, ctx.pp.size, p.virtual_pipeline, p.pipeline_layout)
        self.coords: list[dict] | None = None
        self.calm = [0] * ctx.world_size  # consecutive steps below the threshold, per rank
        self.slowdown = [1.0] * ctx.world_size  # each rank's latest ratio to its peers (update_flags)
        self.loads: deque = deque(maxlen=self.window)  # per step: [world] load (:meth:`load`)
        self.history: deque = deque(maxlen=self.window)  # per step: [world] compute per microbatch
        # per step: (per-layer [pp], fixed [pp * v]) seconds, and the slowest rank's step time; a
        # longer window: they feed the simulator and its prediction
        self.costs: deque = deque(maxlen=2 * self.window)
        self.step_seconds: deque = deque(maxlen=2 * self.window)
        self.flagged: set[int] = set()
        self.even = cfg.train.global_batch_size // (cfg.train.micro_batch_size * ctx.dp.size)

    # ---- hooks ---------------------------------------------------------------------------
    def on_train_start(self, state: TrainState) -> None:
        ctx = state.ctx
        t = torch.zeros(ctx.world_size, 4, dtype=torch.float64)
        t[ctx.rank] = torch.tensor([ctx.dp.rank, ctx.pp.rank, ctx.tp.rank, ctx.cp.rank], dtype=torch.float64)
        ctx.world.host_all_reduce(t)
        self.coords = [dict(zip(("dp", "pp", "tp", "cp"), map(int, row))) for row in t.tolist()]

    def on_step_start(self, state: TrainState) -> None:
        self.clock.take()  # drop what evaluation or the last step left

    def on_step_end(self, state: TrainState, metrics: dict, timings: dict[str, float]) -> None:
        ctx = state.ctx
        reading = self.clock.take()
        counts = state.dp_microbatches or [self.even] * self.dp_size
        wait = max(0.0, timings.get("forward_backward", reading.compute) - reading.compute)
        row = [reading.per_mb, reading.compute, wait, timings.get("step", 0.0), reading.layer_per_mb]
        row += [x for seconds, share in reading.chunks for x in (seconds * share, seconds * (1 - share))]
        t = torch.zeros(ctx.world_size, HEAD + 2 * self.par.virtual_pipeline, dtype=torch.float64)
        t[ctx.rank, :len(row)] = torch.tensor(row, dtype=torch.float64)
        ctx.world.host_all_reduce(t, op=dist.ReduceOp.SUM)
        rows = t.tolist()
        self.step_seconds.append(max(r[3] for r in rows))  # the job's step: its slowest rank's
        # What a microbatch costs on average (the balance needs the throughput, not the best case).
        self.history.append([r[1] / counts[self.coords[i]["dp"]] for i, r in enumerate(rows)])
        self.costs.append(self.stage_costs(rows))
        new = self.update_flags(state, rows)
        if new:
            metrics["failslow"] = new
        self.after_detection(state, metrics)

    # ---- detection -----------------------------------------------------------------------
    def load(self, rows: list[list[float]]) -> list[float | None]:
        """Each rank's layer compute per microbatch per transformer layer of its stage (its
        speed, without the embedding or head it holds); None for a stage without layers."""
        out = []
        for r, row in enumerate(rows):
            n = self.stage_layers(self.coords[r]["pp"])
            out.append(row[4] / n if n else None)
        return out

    def stage_layers(self, pp_rank: int) -> int:
        return self.layers_of(self.sizes, pp_rank)

    def layers_of(self, sizes: list[int], pp_rank: int) -> int:
        """Transformer layers of ``pp_rank`` under ``sizes`` (layers per virtual stage)."""
        return sum(sizes[s] for s in self.stages_of(pp_rank))

    def stages_of(self, pp_rank: int) -> list[int]:
        """The virtual stages of ``pp_rank``, in its local chunk order."""
        return chunk_stages(self.pp_size, self.par.virtual_pipeline, self.par.schedule, pp_rank)

    def stage_costs(self, rows: list[list[float]]) -> tuple[list[float], list[float]]:
        """One step's costs (median spans): seconds per layer per microbatch of each pipeline stage (the
        median over its ranks), and the non-layer seconds per microbatch of each virtual stage.
        A stage without layers gets the median of the others' per-layer cost."""
        per_layer, fixed = [None] * self.pp_size, [0.0] * len(self.sizes)
        for s in range(self.pp_size):
            ranks = [r for r in range(len(rows)) if self.coords[r]["pp"] == s]
            n = self.stage_layers(s)
            if n:
                per_layer[s] = statistics.median(sum(rows[r][HEAD::2]) for r in ranks) / n
            for c, vs in enumerate(self.stages_of(s)):
                fixed[vs] = statistics.median(rows[r][HEAD + 2 * c + 1] for r in ranks)
        known = [x for x in per_layer if x is not None] or [0.0]
        return [statistics.median(known) if x is None else x for x in per_layer], fixed

    def peers(self, r: int) -> list[int]:
        same_stage = [j for j in range(len(self.coords)) if j != r and self.coords[j]["pp"] == self.coords[r]["pp"]]
        return same_stage or [j for j in range(len(self.coords)) if j != r]

    def update_flags(self, state: TrainState, rows: list[list[float]]) -> list[dict]:
        """Flag the ranks whose speed, their best load of the last ``window`` steps, exceeds
        ``threshold x`` the median of their peers' best (a rank preempted by other processes in
        some steps has a good one among them; a fail-slow rank has none); clear a flag after
        ``window`` steps below it. Return the entries of the ranks flagged at this step."""
        self.loads.append(self.load(rows))
        if len(self.loads) < self.window:
            return []
        best = [min((x for x in col if x is not None), default=None) for col in zip(*self.loads)]
        new, cleared = [], False
        for r in range(len(rows)):
            others = [best[j] for j in self.peers(r) if best[j] is not None]
            ratio = best[r] / max(statistics.median(others), 1e-12) if others and best[r] is not None else 1.0
            self.calm[r] = 0 if ratio > self.threshold else self.calm[r] + 1
            if ratio > self.threshold and r not in self.flagged:
                self.flagged.add(r)
                new.append({"rank": r, **self.coords[r], "slowdown": round(ratio, 3), "iteration": state.iteration,
                            "compute_s": rows[r][1], "wait_s": rows[r][2], "window": self.window})
            elif self.calm[r] >= self.window and r in self.flagged:  # recovered: as many steps back
                self.flagged.discard(r)
                cleared = True
            self.slowdown[r] = ratio
        if new or cleared:
            self.measure_afresh()
        for e in new:
            self.say(state, f"rank {e['rank']} (dp {e['dp']}, pp {e['pp']}, tp {e['tp']}, cp {e['cp']}) is "
                            f"fail-slow: {e['slowdown']:.2f}x its peers' compute for {self.window} steps "
                            f"(at iteration {e['iteration']}; compute {e['compute_s']:.4f} s, "
                            f"wait {e['wait_s']:.4f} s)")
        return new

    def measure_afresh(self) -> None:
        """A flag raised or cleared: keep only the ``window`` steps that raised or cleared it of
        the costs and step times. The steps before were of another state (healthy, or the
        first steps of the process, whose warm-up inflates every span); fed to the simulator,
        they mix two speeds into one and the prediction follows neither."""
        for d in (self.costs, self.step_seconds):
            keep = list(d)[-self.window:]
            d.clear()
            d.extend(keep)

    def slow_now(self, ranks) -> set[int]:
        """Those of ``ranks`` that are flagged and over the threshold at this step (a flag stays
        ``window`` steps after the rank's last slow one; a move decided on it then comes late)."""
        return {r for r in ranks if r in self.flagged and self.calm[r] == 0}

    def say(self, state: TrainState, text: str) -> None:
        if state.ctx.rank == 0:
            print(f"[failslow] {text}", flush=True)

    # ---- mitigation (FailSlow) -----------------------------------------------------------
    def after_detection(self, state: TrainState, metrics: dict) -> None:
        """What to do once flags are updated: nothing here (see :class:`FailSlow`)."""

    def on_train_end(self, state: TrainState) -> None:
        self.clock.remove()


class FailSlow(FailSlowDetector):
    """Detection, then mitigation: DP microbatch re-split while a rank is flagged, a proposed
    ``parallel.pipeline_layout`` when a flagged rank's pipeline has several stages, and with
    ``train.failslow_relayout`` / ``train.failslow_restart`` Greyhound's levels 3 and 4 (module
    docstring). Class attributes: ``min_gain``, the least share of the step a re-layout must be
    predicted to save to be considered; ``repropose_gain``, the least share of the step by which
    a new best layout must beat the proposed one to replace it."""

    mitigate = True
    min_gain = 0.1
    repropose_gain = 0.1

    def __init__(self, state: TrainState) -> None:
        super().__init__(state)
        t = state.config.train
        self.relayout_on = t.failslow_relayout and self.pp_size > 1
        self.restart_on = t.failslow_restart and self.relayout_on
        self.start_sizes = list(self.sizes)
        self.hooked = state.chunks  # the chunks the clock hooks; a re-layout swaps the list
        self.relayout_budget, self.restart_budget = SkiRental(), SkiRental()
        self.relayout_cost: float | None = None  # measured seconds of the last re-layout
        self.proposal: dict | None = None  # the logged layout the level-3 budget is renting for
        self.pending: dict | None = None  # the decision of a requested re-layout
        self.applied: dict | None = None  # that decision, applied; its effect not measured yet
        self.laid_for: set[int] = set()  # the ranks the present layout took layers off
        self.round_trips = 0  # returns to the starting layout so far
        self.hosts: list[str] | None = None
        self.left_step: float | None = None  # perf_counter when the last on_step_end returned
        self.warming = True  # the next step is the first of its layout

    def on_train_start(self, state: TrainState) -> None:
        super().on_train_start(state)
        if self.restart_on:  # the restart record names the slow rank's host
            self.hosts = state.ctx.world.all_gather_object(this_host())

    def on_step_start(self, state: TrainState) -> None:
        if state.chunks is not self.hooked:
            self.adopt_layout(state)
        elif self.pending is not None:  # the trainer refused it (and said why): measure afresh
            self.pending = None
        super().on_step_start(state)

    def on_step_end(self, state: TrainState, metrics: dict, timings: dict[str, float]) -> None:
        super().on_step_end(state, metrics, timings)
        self.left_step = time.perf_counter()

    def adopt_layout(self, state: TrainState) -> None:
        """After a re-layout: hook the new chunks, read the new split, take its measured cost
        (from the end of the last step's hooks to now), and measure ``window`` fresh steps."""
        cost = time.perf_counter() - self.left_step if self.left_step is not None else 0.0
        self.clock.remove()
        self.clock, self.hooked = ComputeClock(state.chunks), state.chunks
        cfg = state.config
        self.sizes = stage_sizes(cfg.model.num_layers, self.pp_size, self.par.virtual_pipeline,
                                 cfg.parallel.pipeline_layout)
        self.warming = True
        self.relayout_budget.reset()
        self.restart_budget.reset()
        self.proposal = None
        if self.pending is not None and self.sizes == self.pending["to"]:
            self.relayout_cost, self.applied = cost, self.pending
            self.laid_for = set(self.pending["relieved"])
            if self.pending["reason"] == "recovered":  # back at the start: a new move needs a fresh
                self.round_trips += 1  # flag, and pays twice as long a rent per round trip so far
                self.flagged.clear()
                self.calm = [0] * len(self.calm)
        self.pending = None

    def after_detection(self, state: TrainState, metrics: dict) -> None:
        ctx = state.ctx
        if ctx.dp.size > 1:
            split = self.dp_split(state) if self.flagged else None
            if split != state.dp_microbatches and not self.marginal(split, state.dp_microbatches):
                state.dp_microbatches = split
                metrics["failslow_dp_microbatches"] = split
                self.say(state, f"microbatches per DP rank from the next step: {split or 'even'}")
        if self.pp_size > 1 and metrics.get("failslow") and not self.relayout_on:
            self.propose_for_restart(state, metrics)
        if self.relayout_on and self.warming:  # a layout's first step (allocation, schedule build)
            self.history.clear()  # says little of its speed
            self.costs.clear()
            self.loads.clear()
            self.step_seconds.clear()
        self.warming = False
        if len(self.step_seconds) < self.window or self.pending is not None:
            return  # a full window of this layout's steps first
        if self.applied is not None:
            self.report_effect(state, metrics)
        if self.relayout_on:
            self.maybe_relayout(state, metrics)
        if self.restart_on and self.laid_for and self.pending is None:
            self.maybe_restart(state, metrics)

    def propose_for_restart(self, state: TrainState, metrics: dict) -> None:
        """Without level 3: log the layout :func:`propose_layout` finds, to set at a restart."""
        per_layer, fixed = self.measured_costs()
        layout, now_s, then_s = propose_layout(self.sizes, per_layer, self.pp_size, self.par.virtual_pipeline,
                                               self.par.schedule, self.even, fixed)
        if layout == self.sizes:
            return
        measured = statistics.median(self.step_seconds)
        record = self.proposal_record(state, layout, measured, (now_s, then_s), per_layer, fixed)
        metrics["failslow_layout"] = record
        self.say(state, f"proposed parallel.pipeline_layout={layout} (now {self.sizes}; the simulator predicts "
                        f"{record['predicted_ratio']:.2f}x the step time): set it at the next restart")

    def proposal_record(self, state: TrainState, layout: list[int], measured: float, simulated: tuple[float, float],
                        per_layer: list[float], fixed: list[float]) -> dict:
        """The ``failslow_layout`` record of a proposed layout; ``simulated``: the simulator's step
        now and at ``layout`` (seconds)."""
        now_s, then_s = simulated
        return {"pipeline_layout": list(layout), "current": list(self.sizes), "iteration": state.iteration,
                "predicted_ratio": round(predicted_step(measured, now_s, then_s) / measured, 4),
                "simulated_ratio": round(then_s / now_s, 4), "per_layer_s": [round(x, 6) for x in per_layer],
                "fixed_s": [round(x, 6) for x in fixed]}

    # ---- level 3 -------------------------------------------------------------------------
    def report_effect(self, state: TrainState, metrics: dict) -> None:
        """Log the applied re-layout's measured step against its prediction, and its cost."""
        e = relayout_effect(self.applied, statistics.median(self.step_seconds), self.relayout_cost)
        metrics["failslow_effect"] = e
        self.applied = None
        self.say(state, f"after the re-layout to {e['layout']}: step {e['measured_step_s']:.4f} s measured, "
                        f"{e['predicted_step_s']:.4f} s predicted ({e['prediction_error']:+.1%}); "
                        f"{e['measured_ratio']:.2f}x the step before (predicted {e['predicted_ratio']:.2f}x); "
                        f"the re-layout took {e['relayout_cost_s']:.2f} s")

    def simulate(self, sizes: list[int], per_layer: list[float], fixed: list[float]) -> float:
        """:func:`simulated_step` of this run's pipeline for ``sizes``, in seconds."""
        return simulated_step(sizes, per_layer, self.pp_size, self.par.virtual_pipeline, self.par.schedule,
                              self.even, fixed)

    def relayout_target(self, per_layer: list[float], fixed: list[float]) -> tuple | None:
        """``(layout, simulated step now, simulated step at layout, reason)`` or None.

        Away from the starting layout, once none of the ranks it took layers off is flagged, the
        starting layout if the simulator finds it faster ("recovered"; a flag on another rank,
        which a loaded host may raise for a few steps, does not hold the return back). Else,
        while a rank other than those is flagged, the simulator's best
        layout, when it moves layers no way back (:func:`moves_back`; "slow rank")."""
        if self.sizes != self.start_sizes and not self.flagged & self.laid_for:
            now_s, then_s = self.simulate(self.sizes, per_layer, fixed), self.simulate(self.start_sizes, per_layer, fixed)
            if then_s < now_s:
                return self.start_sizes, now_s, then_s, "recovered"
        if self.flagged and not self.flagged <= self.laid_for:
            layout, now_s, then_s = propose_layout(self.sizes, per_layer, self.pp_size, self.par.virtual_pipeline,
                                                   self.par.schedule, self.even, fixed)
            if not moves_back(self.start_sizes, self.sizes, layout):
                return layout, now_s, then_s, "slow rank"
        return None

    def pinned(self, state: TrainState, metrics: dict, target: tuple, measured: float,
               per_layer: list[float], fixed: list[float]) -> tuple:
        """The target the budget rents for: the layout proposed (and logged) before, unless the
        simulator's best for the costs measured now beats it by ``repropose_gain`` of the step;
        then the new one is proposed, logged with why it replaces the old, and the rent restarts.
        So the layout applied is always the one the last ``proposed`` line named."""
        layout, now_s, then_s, reason = target
        key = (reason,)
        old, why = self.proposal, ""
        if old is not None and old["key"] == key:
            if old["layout"] == layout:
                return target
            old_then = self.simulate(old["layout"], per_layer, fixed)
            if old_then - then_s < self.repropose_gain * measured:
                return old["layout"], now_s, old_then, reason
            why = (f"; it replaces {old['layout']} proposed at iteration {old['iteration']}: with the costs "
                   f"measured since (per layer {[round(x, 6) for x in per_layer]} s, then {old['per_layer_s']} s) "
                   f"it is {old_then - then_s:.4f} s per step faster")
        elif old is not None:
            why = f"; it replaces {old['layout']} proposed at iteration {old['iteration']} ({old['key'][0]})"
        predicted = predicted_step(measured, now_s, then_s)
        record = self.proposal_record(state, layout, measured, (now_s, then_s), per_layer, fixed)
        if old is not None:
            record["replaces"] = {k: old[k] for k in ("layout", "iteration", "per_layer_s", "fixed_s")}
        if old is not None and old["key"] != key:  # another remedy: what was lost waiting for the
            self.relayout_budget.reset()  # old one does not count (a better layout for the same does)
        metrics["failslow_layout"] = record
        self.proposal = {"key": key, "layout": list(layout), "iteration": state.iteration,
                         "per_layer_s": record["per_layer_s"], "fixed_s": record["fixed_s"]}
        self.say(state, f"proposed parallel.pipeline_layout={layout} (now {self.sizes}, {reason}; the simulator "
                        f"predicts {predicted:.4f} s per step against {measured:.4f} s measured): level 3 applies "
                        f"it once the budget says it pays{why}")
        return target

    def maybe_relayout(self, state: TrainState, metrics: dict) -> None:
        """Rent one step of the present layout's loss; request the proposed layout when bought."""
        per_layer, fixed = self.measured_costs()
        measured = statistics.median(self.step_seconds)
        target = self.relayout_target(per_layer, fixed)
        if target is None or target[0] == self.sizes:  # nothing to move to: start over
            self.relayout_budget.reset()
            return
        if target[3] == "slow rank" and len(self.costs) < self.costs.maxlen:
            return  # a move away needs a full window of the slowdown (the return, the measured cost)
        if target[3] == "slow rank" and not self.slow_now(self.flagged - self.laid_for):
            return  # the flag outlives the slowdown by ``window`` steps: no rent, no move on it
        if predicted_step(measured, target[1], target[2]) > (1 - self.min_gain) * measured:
            return  # too small a gain this step (or a noisy one): no rent, but the rent paid stays
        layout, now_s, then_s, reason = self.pinned(state, metrics, target, measured, per_layer, fixed)
        predicted = predicted_step(measured, now_s, then_s)
        prior = state.config.train.failslow_relayout_cost_s
        cost = self.relayout_cost if self.relayout_cost is not None else (
            prior if prior is not None else 2 * measured)
        if reason == "slow rank":  # hysteresis: a noisy flag cannot send the run to and fro
            cost *= 2 ** self.round_trips
        remaining = state.config.train.train_iters - state.iteration
        if not self.relayout_budget.rent(measured - predicted, cost, remaining):
            return
        if reason == "slow rank" and not self.steady(layout, predicted, measured):
            return  # bought, but the costs still drift: the rent stays paid, the move waits
        model = {"per_layer_s": per_layer, "fixed_s": fixed, "simulated_now_s": now_s, "simulated_then_s": then_s,
                 "proposed_at": self.proposal["iteration"]}
        d = relayout_decision(state.iteration, self.sizes, layout, measured, predicted, cost,
                              self.relayout_cost is not None, self.relayout_budget.paid, remaining, reason, model)
        # The ranks this layout is for: those of the stages it takes layers off (a flag raised by
        # the host's load on another rank at the same time is not what the layers moved for).
        d["relieved"] = [r for r in range(len(self.coords)) if self.layers_of(layout, self.coords[r]["pp"])
                         < self.layers_of(self.start_sizes, self.coords[r]["pp"])] if reason == "slow rank" else []
        metrics["failslow_decision"] = d
        self.pending = d
        state.request_relayout(layout)
        self.say(state, f"level 3 ({reason}): re-layout {d['from']} -> {d['to']} online (proposed at iteration "
                        f"{d['proposed_at']}): step {d['measured_step_s']:.4f} s, predicted "
                        f"{d['predicted_step_s']:.4f} s ({d['predicted_ratio']:.2f}x); {d['predicted_gain_s']:.2f} s "
                        f"gained over {remaining} steps against a {d['cost']} cost of {d['relayout_cost_s']:.2f} s "
                        f"(rent paid {d['rent_paid_s']:.2f} s)")

    # ---- level 4 -------------------------------------------------------------------------
    def maybe_restart(self, state: TrainState, metrics: dict) -> None:
        """Rent the gap to a healthy rank at the starting layout; when bought, checkpoint and
        exit with :data:`EXIT_FAILSLOW_RESTART` (every rank decides the same)."""
        slow = self.slow_now(self.laid_for)  # the ranks the re-layout was for, slow at this step
        if not slow:
            if not self.flagged & self.laid_for:  # recovered: start over
                self.restart_budget.reset()
            return
        slow_stages = {self.coords[r]["pp"] for r in slow}
        per_layer, fixed = self.measured_costs()
        healthy = statistics.median([x for s, x in enumerate(per_layer) if s not in slow_stages] or [min(per_layer)])
        rank_of = {vs: s for s in range(self.pp_size) for vs in self.stages_of(s)}
        # A healthy rank does the slow stage's non-layer work faster by the same factor.
        healthy_fixed = [f * (healthy / max(per_layer[rank_of[vs]], 1e-12) if rank_of[vs] in slow_stages else 1.0)
                         for vs, f in enumerate(fixed)]
        measured = statistics.median(self.step_seconds)
        healthy_s = predicted_step(measured, self.simulate(self.sizes, per_layer, fixed),
                                   self.simulate(self.start_sizes, [healthy] * self.pp_size, healthy_fixed))
        loss = measured - healthy_s if slow_stages and measured - healthy_s > self.min_gain * measured else 0.0
        cost, remaining = state.config.train.failslow_restart_cost_s, state.config.train.train_iters - state.iteration
        if not self.restart_budget.rent(loss, cost, remaining):
            return
        rank = max(sorted(slow), key=lambda r: self.slowdown[r])  # by its own compute, not who waits
        d = restart_decision(state.iteration, rank, self.hosts[rank], measured, healthy_s, cost,
                             self.restart_budget.paid, remaining, state.config.checkpoint.save)
        metrics["failslow_decision"] = d
        if state.ctx.rank == 0 or os.environ.get("LOCAL_RANK") == "0":  # each node's launcher reads it
            write_restart_request(state.run_dir, d)
        state.should_stop, state.exit_code = True, EXIT_FAILSLOW_RESTART
        self.say(state, f"level 4: rank {rank} (host {d['host']}) stays slow after the re-layout: step "
                        f"{measured:.4f} s, {healthy_s:.4f} s predicted without it; {d['predicted_gain_s']:.2f} s "
                        f"over {remaining} steps against a restart cost of {cost:.2f} s: saving and exiting "
                        f"with code {EXIT_FAILSLOW_RESTART} for a restart")

    def marginal(self, new: list[int] | None, current: list[int] | None) -> bool:
        """Whether moving from one uneven split to another gains under 5% of the predicted step
        (measurement noise would otherwise move a microbatch back and forth)."""
        if new is None or current is None:
            return False
        t = self.replica_seconds()
        return max(n * x for n, x in zip(new, t)) > 0.95 * max(n * x for n, x in zip(current, t))

    def replica_seconds(self) -> list[float]:
        """Each DP replica's compute per microbatch: its slowest rank's recent median."""
        per_mb = self.median_per_mb()
        return [max(x for r, x in enumerate(per_mb) if self.coords[r]["dp"] == d) for d in range(self.dp_size)]

    def median_per_mb(self) -> list[float]:
        """Each rank's mean compute seconds per microbatch, median over the last ``window`` steps."""
        return [statistics.median(col) for col in zip(*self.history)]

    def dp_split(self, state: TrainState) -> list[int] | None:
        """Microbatches per DP replica in proportion to speed (a replica is as slow as its slowest
        rank), or None when the schedule cannot run the balanced counts."""
        t = self.replica_seconds()
        check = get_schedule(self.par.schedule).check

        def feasible(m: int) -> bool:
            if m < 1:
                return False
            try:
                if check is not None:
                    check(self.pp_size, m, self.par.virtual_pipeline)
            except ValueError:
                return False
            return True

        return balance_microbatches(t, self.even * self.dp_size, feasible)

    def measured_costs(self, last: int | None = None) -> tuple[list[float], list[float]]:
        """The costs the simulator is fed: seconds per layer per microbatch of each pipeline
        stage and non-layer seconds per microbatch of each virtual stage (:meth:`stage_costs`),
        each the median over the last ``last`` steps (None: all of them, up to ``2 x window``
        steps of the present layout and flags)."""
        costs = list(self.costs)[-last:] if last else self.costs
        per_layer = [statistics.median(col) for col in zip(*(c[0] for c in costs))]
        fixed = [statistics.median(col) for col in zip(*(c[1] for c in costs))]
        return per_layer, fixed

    def steady(self, layout: list[int], predicted: float, measured: float) -> bool:
        """Whether the last ``window`` steps alone predict ``layout``'s step within ``min_gain / 2``
        of the ``measured`` step of the ``predicted`` one the whole window gives (seconds).
        While the speeds drift (a slowdown that grows, the warm-up of the first steps), the older
        half of the window is of another state than the steps to come; a move then waits."""
        per_layer, fixed = self.measured_costs(self.window)
        recent = predicted_step(statistics.median(list(self.step_seconds)[-self.window:]),
                                self.simulate(self.sizes, per_layer, fixed), self.simulate(layout, per_layer, fixed))
        return abs(recent - predicted) <= self.min_gain / 2 * measured
