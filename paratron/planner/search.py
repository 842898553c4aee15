"""The ranked plans: enumerate (:mod:`.layouts`), drop what cannot fit, cost the rest best-first.

Every accepted layout gets the cheap terms (stage seconds, fixed per-step seconds, memory with one
microbatch in flight, a lower bound on memory). Candidates are then simulated in order of a lower
bound on their step time (:func:`.bound.pipeline_floor` plus the fixed terms: no schedule the
validator accepts beats it), and the search stops once the next bound exceeds the k-th best
simulated step time (by more than float rounding, ``ROUNDING``). Every layout not simulated thus
has a step time above the k-th best, so the top k are exactly those of simulating every layout
(``tests/test_planner_search.py`` compares the two). A layout's memory (its schedule's in-flight
microbatches) is known before its simulation, so layouts that do not fit are not simulated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from paratron.config import Config
from paratron.rules import validate
from paratron.progress import progress_bar

from .compute import STAGE_WORK_FREE, stage_works
from .estimate import Estimate, Problem, estimate, fixed_seconds, lower_bound, memory_per_rank
from .layout import Layout, to_config
from .layouts import enumerate_layouts
from .pipeline import ScheduleCache

GB = 1e9
ROUNDING = 1e-9
"""Relative slack on the bound: it and the simulation sum the same seconds in other orders."""
ONE_ALIVE = ((1, 0),)
"""The memory floor's flight: one microbatch's activations alive, no weight grad pending (every
schedule reaches it)."""


class PlanError(ValueError):
    """No plan: the message names the input field and the rule (or the memory it would need)."""


@dataclass
class PlanResult:
    """Top plans (best first) and what the search saw."""

    plans: list[Estimate]
    accepted: int
    refused: dict[str, int]
    too_big: int
    simulated: int
    all_layouts: list[Layout] = field(default_factory=list, repr=False)


def plan(prob: Problem, base: Config, top_k: int = 5, cache: ScheduleCache | None = None,
         quiet: bool = True) -> PlanResult:
    """The ``top_k`` fastest layouts that fit in device memory (equal step times: the leaner first).
    Unless ``quiet``, progress bars (:func:`paratron.progress.progress_bar`) count the axis sizes
    enumerated, the layouts bounded, then those simulated and pruned.

    Raises:
        PlanError: no layout is accepted (the most frequent rule is named), or none fits in memory
            (the message gives the smallest memory per rank any layout needs).
    """
    cache = cache or ScheduleCache()
    world = prob.cluster.world
    layouts, refused = enumerate_layouts(base, world, prob.global_batch_size, prob.seq_length, prob.precision,
                                         quiet)
    if not layouts:
        raise PlanError(f"no layout of {world} ranks is accepted for --global-batch-size={prob.global_batch_size} "
                        f"--seq-length={prob.seq_length}; the candidates break:\n  " + "\n  ".join(_by_field(refused)))
    costed = distinct(layouts)
    cands, floors = _candidates(prob, costed, quiet)
    best, too_big, simulated = _best_first(prob, cands, cache, top_k, refused, quiet)
    if not best:
        raise PlanError(_no_fit_message(prob, floors, cache, prob.cluster.hw.memory_bytes))
    for e in best:  # every rule, the deferred one included, on exactly what will be printed
        validate(to_config(base, e.layout, prob.global_batch_size, prob.seq_length, prob.precision), world)
    return PlanResult(best, len(layouts), refused, too_big + len(costed) - len(cands), simulated, layouts)


def rank_key(e: Estimate) -> tuple[float, float, str]:
    """The ranking: step time, then memory per rank, then the layout's name (a total order)."""
    return e.step_time, e.memory.total, e.layout.short()


def _candidates(prob: Problem, costed: list[Layout],
                quiet: bool = True) -> tuple[list[tuple], list[tuple[float, Layout]]]:
    """((step-time bound, layout, stage works, fixed seconds) of the layouts whose memory floor fits,
    best bound first; (memory floor, layout) of all)."""
    cands, floors = [], []
    works_of: dict[Layout, list] = {}  # by the layout less the fields stage seconds never read
    with progress_bar(len(costed), "plan: bound", quiet=quiet, unit="layout") as bar:
        for lay in costed:
            floor = memory_per_rank(prob, lay, [ONE_ALIVE] * lay.pp)[0].total
            floors.append((floor, lay))
            if floor <= prob.cluster.hw.memory_bytes:
                key = dataclasses.replace(lay, **STAGE_WORK_FREE)
                if key not in works_of:
                    works_of[key] = stage_works(prob.shape, lay, prob.cluster, prob.fused_attention)
                works = works_of[key]
                fixed = fixed_seconds(prob, lay, works)
                cands.append((lower_bound(prob, lay, works, fixed), lay, works, fixed))
            bar.update()
    cands.sort(key=lambda c: c[0])
    return cands, floors


def _best_first(prob: Problem, cands: list[tuple], cache: ScheduleCache, top_k: int,
                refused: dict[str, tuple[int, int]], quiet: bool = True) -> tuple[list[Estimate], int, int]:
    """(top ``top_k`` estimates, layouts too big with their schedule's in-flight microbatches,
    layouts simulated); stops at the first bound above the k-th best (module docstring)."""
    with progress_bar(len(cands), "plan: simulate", quiet=quiet, unit="layout") as bar:
        return _best_first_loop(prob, cands, cache, top_k, refused, bar)


def _best_first_loop(prob, cands, cache, top_k, refused, bar) -> tuple[list[Estimate], int, int]:
    best: list[Estimate] = []
    too_big = simulated = 0
    for i, (lb, lay, works, fixed) in enumerate(cands):
        bar.set_postfix(simulated=simulated, too_big=too_big, refresh=False)
        bar.update()
        if len(best) >= top_k and lb > best[-1].step_time * (1 + ROUNDING):
            bar.set_postfix(simulated=simulated, too_big=too_big, pruned=len(cands) - i, refresh=False)
            bar.update(len(cands) - i - 1)
            break
        try:
            m = lay.microbatches(prob.global_batch_size)
            mem = memory_per_rank(prob, lay, cache.flight(lay.schedule, lay.pp, m, lay.vpp))
            if mem[0].total > prob.cluster.hw.memory_bytes:  # known before simulating
                too_big += 1
                continue
            est = estimate(prob, lay, cache, works, fixed, mem)
        except ValueError as e:  # the deferred schedule rule refused its lists
            refused[str(e)[:160]] = (len(refused), refused.get(str(e)[:160], (0, 0))[1] + 1)
            continue
        simulated += 1
        best.append(est)
        best.sort(key=rank_key)
        del best[top_k:]
    return best, too_big, simulated


def distinct(layouts: list[Layout]) -> list[Layout]:
    """The layouts worth costing: with one pipeline stage every schedule and chunk count runs the
    same work, so only ``1f1b`` with one chunk is kept (the others stay counted as accepted)."""
    return [lay for lay in layouts if lay.pp > 1 or (lay.schedule == "1f1b" and lay.vpp == 1)]


def _by_field(refused: dict[str, tuple[int, int]], fields: int = 5) -> list[str]:
    """The most frequent rule of each input field named first in a message (the batch, the sequence,
    the heads, ...), before the planner's own parallel.* fields, at most ``fields`` lines."""
    best: dict[str, tuple[int, str]] = {}
    for rule, (_, n) in refused.items():
        field = rule.split("=", 1)[0]
        if n > best.get(field, (0, ""))[0]:
            best[field] = (n, rule)
    order = sorted(best.items(), key=lambda kv: (kv[0].startswith("parallel."), -kv[1][0]))[:fields]
    return [f"{rule} ({n} layouts)" for _, (n, rule) in order]


def _no_fit_message(prob: Problem, floors: list, cache: ScheduleCache, limit: float) -> str:
    floors.sort(key=lambda f: f[0])
    smallest = min((estimate(prob, lay, cache) for _, lay in floors[:20]), key=lambda e: e.memory.total)
    m = smallest.memory
    return (f"the model fits on no accepted layout of {prob.cluster.world} ranks: the smallest memory per rank "
            f"any layout needs is {human_bytes(m.total)} ({smallest.layout.short()}: params "
            f"{human_bytes(m.params)}, grads {human_bytes(m.grads)}, optimizer {human_bytes(m.optimizer)}, "
            f"activations {human_bytes(m.activations + m.transient)}), more than the device memory "
            f"{human_bytes(limit)} (--memory-gb); use more devices or a smaller model")


def human_bytes(n: float) -> str:
    """``123.4 MB`` style (decimal units, as --memory-gb)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
