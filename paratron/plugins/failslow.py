"""Fail-slow detection and mitigation, as a training-loop plugin (Greyhound, Wu et al., ATC'25).

A fail-slow rank still works, only slower, and every collective makes its peers wait for it. The
plugin is built on public extension points only: the :class:`~paratron.training.callbacks.Callback`
hooks, module hooks on the model chunks, and :attr:`TrainState.dp_microbatches` (the one
extension point added for it: a callback may split the next global batch unevenly over DP).

Enable it with ``train.callbacks = ["paratron.plugins.failslow:FailSlow"]`` (detection and
mitigation) or ``"paratron.plugins.failslow:FailSlowDetector"`` (detection only).

**Detect.** Each rank measures its compute seconds per step (:class:`ComputeClock`: from each
chunk's forward start to its end, and from the first grad of a chunk's output to the last
parameter grad accumulated in that backward) and its wait, ``forward_backward - compute`` (the
rest of the step's device work: collectives and p2p). Once a step, one host all-reduce of
``[world, 3]`` floats shares ``(compute per microbatch, compute, wait)``; compute per microbatch
is the shortest forward plus the shortest backward of the step (per chunk), which load from
other processes on the host cannot inflate. A rank's load is its
compute per microbatch per transformer layer of its pipeline stage (the predicted cost); its
peers are the ranks of the same pipeline stage (over DP, TP, CP), or with ``DP = 1`` every
other stage. A rank is flagged when its load exceeds ``threshold x`` the median of its peers'
for ``window`` consecutive steps: one ``[failslow]`` line, and a ``failslow`` entry in that
step's ``metrics.jsonl`` record naming the rank, its coordinates and the slowdown. The flag is
cleared after ``window`` consecutive steps below the threshold.

**Mitigate over DP** (:class:`FailSlow`). While a rank is flagged, each DP replica's speed is
the slowest of its ranks (compute per microbatch, median of the last ``window`` steps), and the
next steps' microbatches are split over the replicas to minimise the slowest one's time
(:func:`balance_microbatches`). The global batch, its samples and the global token-mean loss are
unchanged: only which replica computes which microbatch moves (the sum order of the grads does).

**Mitigate over PP.** When the flagged rank's pipeline has more than one stage, the plugin
proposes a ``parallel.pipeline_layout`` that moves layers off the slow stage, chosen with the
pipeline simulator (:func:`propose_layout`), and records it with the simulator's predicted
step-time ratio. It is applied at the next restart (set it in the config).
"""

from __future__ import annotations

import statistics
import time
from collections import deque

import torch
import torch.distributed as dist

from paratron.pipeline.actions import halves
from paratron.pipeline.partition import chunk_stages, stage_sizes
from paratron.pipeline.registry import build_schedule, get_schedule
from paratron.pipeline.simulator import simulate
from paratron.training.callbacks import Callback, TrainState


class ComputeClock:
    """This rank's compute seconds, from hooks on the model chunks (no device sync: on a GPU the
    host times are launch times; the detector is meant for host-bound or synchronous work and
    for the CPU).

    Forward: a chunk's forward pre-hook to its forward hook. Backward: from the hook on the
    chunk's output grad (the start of that chunk's backward) to the last parameter's
    post-accumulate-grad hook before the next forward or backward starts. Collectives inside a
    chunk (TP, ZeRO-3 gathers) count as compute; the pipeline's p2p and DP's grad sync do not.
    Each span is also kept per (chunk, forward or backward), for :meth:`take`'s per-microbatch
    figure.
    """

    def __init__(self, chunks) -> None:
        self.spans: dict[tuple[int, str], list[float]] = {}
        self._fwd_start: float | None = None
        self._bwd: tuple[int, float] | None = None  # (chunk index, start) of the open backward
        self._last_grad = 0.0
        self.handles = []
        for i, chunk in enumerate(chunks):
            self.handles.append(chunk.register_forward_pre_hook(self._forward_begins))
            self.handles.append(chunk.register_forward_hook(self._forward_ends(i)))
            for p in chunk.parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._grad_done))

    def _forward_begins(self, module, args) -> None:
        self._close_backward()
        self._fwd_start = time.perf_counter()

    def _forward_ends(self, i: int):
        def hook(module, args, out) -> None:
            if self._fwd_start is not None:
                self.spans.setdefault((i, "F"), []).append(time.perf_counter() - self._fwd_start)
                self._fwd_start = None
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda grad: self._backward_begins(i))

        return hook

    def _backward_begins(self, i: int) -> None:
        self._close_backward()
        self._last_grad = time.perf_counter()
        self._bwd = (i, self._last_grad)

    def _grad_done(self, param) -> None:
        self._last_grad = time.perf_counter()

    def _close_backward(self) -> None:
        if self._bwd is not None:
            i, start = self._bwd
            self.spans.setdefault((i, "B"), []).append(max(0.0, self._last_grad - start))
            self._bwd = None

    def take(self) -> tuple[float, float]:
        """``(compute seconds, seconds per microbatch)`` since the last call, and restart.

        Per microbatch: the sum over chunks and directions of the *shortest* span. On a shared
        host, preemption only ever adds time, so the minimum is the rank's speed; a rank that is
        slow for good is slow in every span (Greyhound's fail-slow is sustained).
        """
        self._close_backward()
        total = sum(sum(v) for v in self.spans.values())
        per_mb = sum(min(v) for v in self.spans.values())
        self.spans = {}
        return total, per_mb

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


def simulated_step(sizes: list[int], per_layer: list[float], p: int, v: int, schedule: str, m: int) -> float:
    """The simulator's makespan of one step with ``sizes`` layers per virtual stage, when a layer
    on pipeline rank ``r`` costs ``per_layer[r]`` per microbatch (F = B = W, BW = B + W)."""
    rank_of = {s: r for r, stages in enumerate(get_schedule(schedule).placement(p, v)) for s in stages}
    weight = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}

    def cost(a) -> float:
        # An FB pair (dualpipev) costs its two halves: a slowed rank's pair hides nothing.
        return sum(weight[h.kind] * (sizes[h.stage] * per_layer[rank_of[h.stage]] + 1e-9) for h in halves(a))

    return simulate(build_schedule(schedule, p, m, v, check=False), cost).makespan


def propose_layout(sizes: list[int], per_layer: list[float], p: int, v: int, schedule: str,
                   m: int) -> tuple[list[int], float, float]:
    """A ``parallel.pipeline_layout`` for measured per-layer costs ``per_layer`` (seconds per
    layer per microbatch on each pipeline rank), by local search with the pipeline simulator:
    move one layer between neighbouring virtual stages while the simulated step gets shorter.

    Returns:
        ``(layout, simulated step of sizes, simulated step of layout)``.
    """
    best = list(sizes)
    best_t = start_t = simulated_step(best, per_layer, p, v, schedule, m)
    improved = True
    while improved:
        improved = False
        for i in range(len(best) - 1):
            for src, dst in ((i, i + 1), (i + 1, i)):
                if best[src] == 0:
                    continue
                cand = list(best)
                cand[src] -= 1
                cand[dst] += 1
                t = simulated_step(cand, per_layer, p, v, schedule, m)
                if t < best_t - 1e-12:
                    best, best_t, improved = cand, t, True
    return best, start_t, best_t


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
        self.streak = [0] * ctx.world_size  # consecutive steps above the threshold, per rank
        self.calm = [0] * ctx.world_size  # consecutive steps below it
        self.history: deque = deque(maxlen=self.window)  # per step: [world] compute per microbatch
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
        compute, per_mb = self.clock.take()
        wait = max(0.0, timings.get("forward_backward", compute) - compute)
        t = torch.zeros(ctx.world_size, 3, dtype=torch.float64)
        t[ctx.rank] = torch.tensor([per_mb, compute, wait], dtype=torch.float64)
        ctx.world.host_all_reduce(t, op=dist.ReduceOp.SUM)
        rows = t.tolist()
        # What a microbatch costs on average (the balance needs the throughput, not the best case).
        counts = state.dp_microbatches or [self.even] * self.dp_size
        self.history.append([r[1] / counts[self.coords[i]["dp"]] for i, r in enumerate(rows)])
        new = self.update_flags(state, rows)
        if new:
            metrics["failslow"] = new
        self.after_detection(state, metrics)

    # ---- detection -----------------------------------------------------------------------
    def load(self, per_mb: list[float]) -> list[float]:
        """Compute per microbatch per layer of each rank's stage (its predicted cost)."""
        layers = [max(1, self.stage_layers(self.coords[r]["pp"])) for r in range(len(per_mb))]
        return [x / n for x, n in zip(per_mb, layers)]

    def stage_layers(self, pp_rank: int) -> int:
        return sum(self.sizes[s] for s in chunk_stages(self.pp_size, self.par.virtual_pipeline,
                                                       self.par.schedule, pp_rank))

    def peers(self, r: int) -> list[int]:
        same_stage = [j for j in range(len(self.coords)) if j != r and self.coords[j]["pp"] == self.coords[r]["pp"]]
        return same_stage or [j for j in range(len(self.coords)) if j != r]

    def update_flags(self, state: TrainState, rows: list[list[float]]) -> list[dict]:
        """Advance each rank's streak; return the entries of the ranks flagged at this step."""
        load = self.load([r[0] for r in rows])
        new = []
        for r in range(len(rows)):
            others = [load[j] for j in self.peers(r)]
            ratio = load[r] / max(statistics.median(others), 1e-12) if others else 1.0
            slow = ratio > self.threshold
            self.streak[r] = self.streak[r] + 1 if slow else 0
            self.calm[r] = 0 if slow else self.calm[r] + 1
            if self.streak[r] >= self.window and r not in self.flagged:
                self.flagged.add(r)
                new.append({"rank": r, **self.coords[r], "slowdown": round(ratio, 3), "iteration": state.iteration,
                            "compute_s": rows[r][1], "wait_s": rows[r][2], "window": self.window})
            elif self.calm[r] >= self.window and r in self.flagged:  # recovered: as many steps back
                self.flagged.discard(r)
        for e in new:
            self.say(state, f"rank {e['rank']} (dp {e['dp']}, pp {e['pp']}, tp {e['tp']}, cp {e['cp']}) is "
                            f"fail-slow: {e['slowdown']:.2f}x its peers' compute for {self.window} steps "
                            f"(at iteration {e['iteration']}; compute {e['compute_s']:.4f} s, "
                            f"wait {e['wait_s']:.4f} s)")
        return new

    def say(self, state: TrainState, text: str) -> None:
        if state.ctx.rank == 0:
            print(f"[failslow] {text}", flush=True)

    # ---- mitigation (FailSlow) -----------------------------------------------------------
    def after_detection(self, state: TrainState, metrics: dict) -> None:
        """What to do once flags are updated: nothing here (see :class:`FailSlow`)."""

    def on_train_end(self, state: TrainState) -> None:
        self.clock.remove()


class FailSlow(FailSlowDetector):
    """Detection, then mitigation: DP microbatch re-split while a rank is flagged, and a proposed
    ``parallel.pipeline_layout`` when a flagged rank's pipeline has several stages."""

    mitigate = True

    def after_detection(self, state: TrainState, metrics: dict) -> None:
        ctx = state.ctx
        if ctx.dp.size > 1:
            split = self.dp_split(state) if self.flagged else None
            if split != state.dp_microbatches and not self.marginal(split, state.dp_microbatches):
                state.dp_microbatches = split
                metrics["failslow_dp_microbatches"] = split
                self.say(state, f"microbatches per DP rank from the next step: {split or 'even'}")
        if self.pp_size > 1 and metrics.get("failslow"):
            proposal = self.layout_proposal()
            if proposal is not None:
                metrics["failslow_layout"] = proposal
                self.say(state, f"proposed parallel.pipeline_layout={proposal['pipeline_layout']} "
                                f"(now {proposal['current']}; the simulator predicts "
                                f"{proposal['predicted_ratio']:.2f}x the step time): set it at the next restart")

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

    def layout_proposal(self) -> dict | None:
        """The layout :func:`propose_layout` finds for the measured per-layer costs per stage."""
        per_mb = self.median_per_mb()
        per_layer = []
        for s in range(self.pp_size):
            ranks = [r for r in range(len(per_mb)) if self.coords[r]["pp"] == s]
            per_layer.append(statistics.median(per_mb[r] for r in ranks) / max(1, self.stage_layers(s)))
        layout, before, after = propose_layout(self.sizes, per_layer, self.pp_size, self.par.virtual_pipeline,
                                               self.par.schedule, self.even)
        if layout == self.sizes:
            return None
        return {"pipeline_layout": layout, "current": list(self.sizes), "predicted_ratio": round(after / before, 4),
                "per_layer_s": per_layer}
