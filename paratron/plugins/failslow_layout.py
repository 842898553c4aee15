"""The fail-slow plugin's pipeline cost model: the simulated step of a layout for measured stage
costs, and the layout the simulator finds best (Greyhound, Wu et al., ATC'25, section 4.3: a
re-configuration chosen from a model of the pipeline fed with measured speeds).

A stage's compute per microbatch is ``fixed[s] + sizes[s] * per_layer[r]``: a per-layer cost of
the pipeline rank ``r`` that holds virtual stage ``s``, times its transformer layers, plus what
does not move with the layers (the embedding on the first stage, the final norm, output layer and
loss on the last). Counting the head as layer work overstates a stage's per-layer cost by
``fixed / sizes``, and more so the fewer layers it keeps; a layout search on such figures
overshoots (it empties the head's stage).

The simulator (:func:`paratron.pipeline.simulator.simulate`) gives the makespan of the
schedule's actions only; what it does not model (the optimizer step, the data, the p2p latency
between stages) is taken as unchanged by a re-layout: :func:`predicted_step` adds the simulated
difference to the measured step rather than scaling it.
"""

from __future__ import annotations

from paratron.pipeline.actions import halves
from paratron.pipeline.registry import build_schedule, get_schedule
from paratron.pipeline.simulator import simulate

_SHARE = {"F": 1.0, "B": 1.0, "W": 1.0, "BW": 2.0}
"""Each action's thirds of a microbatch's compute (forward : input grad : weight grad = 1 : 1 : 1,
the usual estimate of a transformer layer's backward as twice its forward)."""


def simulated_step(sizes: list[int], per_layer: list[float], p: int, v: int, schedule: str, m: int,
                   fixed: list[float] | None = None) -> float:
    """The simulator's makespan in seconds of one step of ``m`` microbatches.

    Args:
        sizes: transformer layers per virtual stage (``p * v``, model order).
        per_layer: seconds per layer per microbatch (forward + backward) on each pipeline rank.
        fixed: seconds per microbatch of each virtual stage's non-layer work (None: 0).
    """
    rank_of = {s: r for r, stages in enumerate(get_schedule(schedule).placement(p, v)) for s in stages}
    fixed = fixed or [0.0] * len(sizes)

    def cost(a) -> float:
        # An FB pair (dualpipev) costs its two halves: a slowed rank's pair hides nothing.
        return sum(_SHARE[h.kind] / 3 * (fixed[h.stage] + sizes[h.stage] * per_layer[rank_of[h.stage]]) + 1e-12
                   for h in halves(a))

    return simulate(build_schedule(schedule, p, m, v, check=False), cost).makespan


def propose_layout(sizes: list[int], per_layer: list[float], p: int, v: int, schedule: str, m: int,
                   fixed: list[float] | None = None, min_layers: int = 1) -> tuple[list[int], float, float]:
    """A ``parallel.pipeline_layout`` for measured costs, by local search with the simulator:
    move one layer between neighbouring virtual stages while the simulated step gets shorter.
    A stage keeps at least ``min_layers`` layers (if it had them): a stage without layers has
    no per-layer speed left to measure, so its recovery could not be seen.

    Returns:
        ``(layout, simulated step of sizes, simulated step of layout)``, in seconds.
    """
    best = list(sizes)
    best_t = start_t = simulated_step(best, per_layer, p, v, schedule, m, fixed)
    improved = True
    while improved:
        improved = False
        for i in range(len(best) - 1):
            for src, dst in ((i, i + 1), (i + 1, i)):
                if best[src] == 0 or best[src] <= min(min_layers, sizes[src]):
                    continue
                cand = list(best)
                cand[src] -= 1
                cand[dst] += 1
                t = simulated_step(cand, per_layer, p, v, schedule, m, fixed)
                if t < best_t - 1e-12:
                    best, best_t, improved = cand, t, True
    return best, start_t, best_t


def predicted_step(measured_s: float, simulated_now_s: float, simulated_then_s: float) -> float:
    """The step predicted after a re-layout: the measured step minus the simulated saving (the
    unmodelled rest of the step stays). When the simulator's step exceeds the measured one (its
    costs overstate the step), the saving is scaled to the measured step instead."""
    if simulated_now_s <= measured_s:
        return measured_s - (simulated_now_s - simulated_then_s)
    return measured_s * simulated_then_s / max(simulated_now_s, 1e-12)
