"""Cross-microbatch F/B overlap: fuse a forward and a backward of two microbatches into one ``FB``.

DeepSeek-V3 (DeepSeek-AI 2024, section 3.2.1, "DualPipe") pairs the forward chunk of one
microbatch with the backward chunk of another on the same rank, so that the expert-parallel
all-to-alls of each run while the other computes. Here that is a transformation of action
lists: :func:`overlap_fb` replaces neighbouring ``F`` and ``B``/``BW`` actions of different
microbatches on one rank by one ``FB`` action (:func:`~paratron.pipeline.actions.FB`), which

* the validator accepts when both halves' inputs are ready before the pair and neither half
  depends on the other (:func:`~paratron.pipeline.validate.validate`);
* the simulator costs as ``max(F + B - comm_F - comm_B, comm_F + comm_B)``
  (:class:`~paratron.pipeline.simulator.Costs`);
* the runtime runs interleaved: the backward half in layer segments, one while each all-to-all
  of the forward half is in flight (:mod:`.runtime`).

A pair waits for both halves' inputs and sends both outputs at its end, so fusing can delay the
neighbours (in 1F1B a forward would wait for the grad its partner needs). :func:`overlap_fb`
therefore keeps a pair only if the lists still run and the simulated makespan does not grow.
"""

from __future__ import annotations

from .actions import FB, Action, activation_peak
from .schedules import with_p2p
from .simulator import Costs, simulate
from .validate import ScheduleError, validate

DEFAULT_COSTS = Costs(F=1.0, B=1.0, W=1.0, comm_F=0.25, comm_B=0.25)
"""Costs :func:`overlap_fb` plans with when none are given: a quarter of each forward and of each
backward pass waiting on all-to-alls (MoE layers in every layer, EP across nodes)."""


def pair_of(x: Action, y: Action) -> Action | None:
    """The ``FB`` fusing compute actions ``x`` and ``y`` (either order: one ``F``, one ``B`` or
    ``BW``), or None when they are not such two actions or belong to the same microbatch and
    stage (a backward cannot overlap its own forward)."""
    kinds = {x.kind, y.kind}
    if "F" not in kinds or not kinds & {"B", "BW"} or len(kinds) != 2:
        return None
    f, b = (x, y) if x.kind == "F" else (y, x)
    if (f.microbatch, f.stage) == (b.microbatch, b.stage):
        return None
    return FB(f, b)


def _candidates(order: list[Action]):
    """(index of the first, index of the second, pair) for each neighbouring F and B/BW of one
    rank's compute order; W actions between them may be skipped (they move after the pair)."""
    for i, x in enumerate(order):
        if x.kind not in ("F", "B", "BW"):
            continue
        j = i + 1
        while j < len(order) and order[j].kind == "W":
            j += 1
        if j < len(order) and (pair := pair_of(x, order[j])) is not None:
            yield i, j, pair


def _fused(order: list[Action], i: int, j: int, pair: Action) -> list[Action]:
    return order[:i] + [pair] + order[i + 1:j] + order[j + 1:]


def overlap_fb(schedule: list[list[Action]], costs: Costs | None = None, *,
               memory_budget: int | None = None) -> list[list[Action]]:
    """Fuse neighbouring forward and backward actions of different microbatches into ``FB``
    pairs wherever that keeps the lists valid and does not lengthen the simulated step.

    Args:
        schedule: one action list per pipeline rank (a registered schedule's, or any valid lists);
            their send/recv actions are rebuilt by :func:`~paratron.pipeline.schedules.with_p2p`.
        costs: what the simulator charges (``comm_F``/``comm_B`` > 0 make pairs pay off);
            default :data:`DEFAULT_COSTS`.
        memory_budget: if given, a pair is refused when it would raise a rank's peak in-flight
            activations (:func:`~paratron.pipeline.actions.activation_peak`) above it. A pair
            holds both halves' activations at once, so a backward paired with the forward that
            followed it raises that rank's peak by one; None: no limit.

    Returns:
        New lists: the same compute, some of it in ``FB`` pairs, with sends and receives placed
        around the pairs. Ranks are visited in order and each rank's list from its start; a pair
        is kept when the lists validate and the makespan is not larger than before it.

    Raises:
        ScheduleError: the input lists themselves do not validate.
    """
    costs = DEFAULT_COSTS if costs is None else costs
    m = 1 + max((a.microbatch for acts in schedule for a in acts), default=-1)
    validate(schedule, m)
    orders = [[a for a in acts if not a.is_p2p] for acts in schedule]
    best = simulate(with_p2p(orders), costs).makespan
    for r in range(len(orders)):
        start = 0
        while True:
            found = next(((i, j, pair) for i, j, pair in _candidates(orders[r]) if i >= start), None)
            if found is None:
                break
            i, j, pair = found
            start = i + 1
            trial = orders[:r] + [_fused(orders[r], i, j, pair)] + orders[r + 1:]
            if memory_budget is not None and activation_peak(trial[r]) > memory_budget:
                continue
            try:  # the halves' own-rank rules hold by construction; a deadlock raises here
                span = simulate(with_p2p(trial), costs).makespan
            except ScheduleError:
                span = None
            if span is not None and span <= best:
                orders, best = trial, span
    lists = with_p2p(orders)
    validate(lists, m)
    return lists
