"""Recompute placed in the pipeline bubbles (Obscura; Chen et al., USENIX ATC 2025).

Full activation recompute (Chen et al. 2016; Korthikanti et al. 2022, section 4) runs each
forward twice: once without keeping activations, and again (``R``) right before the backward
that needs them. That second forward then sits on the critical path of every backward: in 1F1B
the grad of a microbatch crosses each rank only after that rank has recomputed it.

Obscura's observation is that pipeline ranks idle anyway, in the warm-up and cool-down bubbles
and while waiting for a receive, so a recompute can run there, ahead of the grad that needs
it. Running it early holds its activations longer, so how early is bounded by a memory budget.

Two transformations on action lists (:mod:`.actions`):

* :func:`with_full_recompute` turns a schedule into plain full recompute: ``R(mb, s)`` right
  before every backward of ``(mb, s)``;
* :func:`place_recompute` moves each ``R`` to the earliest idle slot (a wait on a receive, found
  by simulating the lists) where the rank's peak in-flight activations stay within the budget
  and the simulated makespan does not grow.

Both work on any schedule's lists (1F1B, interleaved, ZB-H1, ...); the runtime executes ``R``
without further change.
"""

from __future__ import annotations

from typing import Callable

from .actions import Action, R, activation_peak, batches
from .simulator import Costs, SimResult, simulate
from .validate import ScheduleError, validate

UNIT_COSTS = Costs(F=1.0, B=1.0, W=1.0, R=1.0)
"""Default costs for finding the idle slots: unit F, B, W and R (BW = B + W)."""


def with_full_recompute(lists: list[list[Action]]) -> list[list[Action]]:
    """Insert ``R(mb, s)`` right before every ``B``/``BW`` of ``(mb, s)``: plain full recompute,
    the recompute on the backward's critical path (after its grad arrived)."""
    out = []
    for acts in lists:
        new = []
        for a in acts:
            if a.kind in ("B", "BW"):
                new.append(R(a.microbatch, a.stage))
            new.append(a)
        out.append(new)
    return out


def place_recompute(lists: list[list[Action]], memory_budget: int,
                    costs: Costs | Callable[[Action], float] = UNIT_COSTS) -> list[list[Action]]:
    """Move every ``R`` of a full-recompute schedule as early as ``memory_budget`` allows into
    the idle slots that ``costs`` predict.

    Args:
        lists: one action list per pipeline rank, each backward preceded somewhere by its ``R``
            (e.g. :func:`with_full_recompute` of a registered schedule).
        memory_budget: the most full activations (one per (microbatch, stage) between its ``R``
            and the end of its ``BW``/``W``) a rank may hold at once
            (:func:`~paratron.pipeline.actions.activation_peak`); at least 1.
        costs: action durations used to find where ranks wait (:func:`.simulate`).

    Returns:
        New lists, the same actions in another order, valid under
        ``validate(..., memory_budget=memory_budget)``. An idle slot is a batch of receives a rank
        waits at; an ``R`` goes right before the batch's receives (after its sends, which thus
        still leave at once). A move is kept when the simulated makespan does not grow; moves are
        repeated until none is possible, so the result is a local optimum, not a proven one.

    Raises:
        ValueError: ``memory_budget < 1``, or a backward without an ``R`` in ``lists``.
        ScheduleError: ``lists`` do not validate within the budget to begin with.
    """
    if memory_budget < 1:
        raise ValueError(f"memory_budget={memory_budget} must be >= 1 (one recomputed activation at a time)")
    for r, acts in enumerate(lists):
        has_r = {(a.microbatch, a.stage) for a in acts if a.kind == "R"}
        missing = [a for a in acts if a.kind in ("B", "BW") and (a.microbatch, a.stage) not in has_r]
        if missing:
            raise ValueError(f"rank {r}: {missing[0]} has no R; place_recompute takes a full-recompute "
                             "schedule (see with_full_recompute)")
    lists = [list(acts) for acts in lists]
    validate(lists, memory_budget=memory_budget)
    best = simulate(lists, costs)
    moved = True
    while moved:
        moved = False
        for r in range(len(lists)):
            for a in [a for a in lists[r] if a.kind == "R"]:
                result = _move_earlier(lists, r, a, memory_budget, costs, best)
                if result is not None:
                    lists[r], best = result
                    moved = True
    return lists


def _idle_slots(acts: list[Action], spans) -> list[int]:
    """Indices in ``acts`` right before the receives of each batch the rank waits at."""
    slots, i = [], 0
    waits = [s.end > s.start for s in spans]  # spans follow the list order one to one
    for step in batches(acts):
        recv = next((k for k, a in enumerate(step) if a.kind.startswith("RECV")), None)
        if recv is not None and waits[i + recv]:
            slots.append(i + recv)
        i += len(step)
    return slots


def _move_earlier(lists, r: int, a: Action, budget: int, costs, best: SimResult):
    """The rank's list with ``a`` moved to its earliest acceptable idle slot, and its simulation;
    None when no slot before its current place is acceptable."""
    acts = lists[r]
    here = acts.index(a)
    first = acts.index(Action("F", a.microbatch, a.stage)) + 1
    for slot in _idle_slots(acts, best.spans[r]):
        if not first <= slot < here:
            continue
        trial = acts[:here] + acts[here + 1:]
        trial.insert(slot, a)
        if activation_peak(trial) > budget:
            continue
        candidate = lists[:r] + [trial] + lists[r + 1:]
        try:
            result = simulate(candidate, costs)
        except ScheduleError:
            continue
        if result.makespan <= best.makespan + 1e-9:
            return trial, result
    return None
