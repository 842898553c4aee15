"""Pipeline makespan, bubble and in-flight microbatches, from the schedule's own action lists.

The lists come from :func:`paratron.pipeline.registry.build_schedule` (the ones the runtime runs);
:func:`paratron.pipeline.simulator.simulate` executes them with each action's seconds from
:mod:`.compute` and the stage-boundary p2p time as latency. The peak number of microbatch
activations a rank holds depends only on the order of its own list (+1 at F, -1 at BW or W), so it
is read from the lists directly, before any costing (it bounds memory, Korthikanti et al. 2022,
section 4.2: 1F1B keeps ``p - r`` microbatches on rank ``r``, GPipe all ``m``).

Zero-bubble schedules (Qi et al. 2023, section 2) split a microbatch's backward: its ``B`` frees
the activations autograd saved, but queues each linear's weight-grad closure, which holds that
linear's input and output grad until the ``W`` (``layers/linear.py``). So a rank's memory is
counted from two numbers at each point of its list (:func:`flight_states`): the microbatches
whose activations are alive (``F`` to ``B``) and those whose ``W`` is pending (``B`` to ``W``).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratron.pipeline.actions import Action, expand, halves, recomputed
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.simulator import simulate
from paratron.pipeline.validate import validate

from .compute import Work

Flight = tuple[tuple[int, int], ...]
"""The ``(activations alive, weight grads pending)`` pairs of one rank that may set its peak."""


@dataclass(frozen=True)
class PipelineCost:
    """Makespan (s) of one step's schedule, mean bubble fraction over ranks, per-rank busy time."""

    makespan: float
    bubble: float
    busy: tuple[float, ...]


class ScheduleCache:
    """Action lists and per-rank peak in-flight counts, built once per (schedule, p, m, v), and
    their simulated cost, once per distinct stage costs.

    Lists are proved (what ``build_schedule(check=True)`` does: the validator's schedule rule,
    which enumeration defers to here, :mod:`.layouts`) before they are simulated; a failing
    schedule raises ``ValueError``.
    """

    def __init__(self) -> None:
        self._lists: dict[tuple[str, int, int, int], list[list[Action]] | ValueError] = {}
        self._costs: dict[tuple, PipelineCost] = {}
        self._flights: dict[tuple[str, int, int, int], list[Flight]] = {}
        self._proved: set[tuple[str, int, int, int]] = set()

    def makespan(self, name: str, p: int, m: int, v: int, works: list[Work], p2p_seconds: float,
                 sharing: float = 1.0) -> PipelineCost:
        """:func:`makespan` of the schedule's lists, simulated once per distinct costs (layouts that
        differ only in what the pipeline does not see, e.g. the ZeRO level, share one simulation).

        Raises:
            ValueError: the schedule's lists fail their proof, or deadlock.
        """
        key = (name, p, m, v, tuple(works), p2p_seconds, sharing)
        if key not in self._costs:
            self._costs[key] = makespan(self.lists(name, p, m, v), works, p2p_seconds, sharing)
        return self._costs[key]

    def lists(self, name: str, p: int, m: int, v: int, *, proved: bool = True) -> list[list[Action]]:
        """The schedule's lists; ``proved``: also proved by the validator (the deferred schedule
        rule, once per key). Counting in-flight microbatches needs no proof, and most layouts the
        search looks at are dropped for memory before they are simulated.

        Raises:
            ValueError: the schedule refuses (p, m, v), or (``proved``) its lists fail the proof.
        """
        key = (name, p, m, v)
        if key not in self._lists:
            try:
                self._lists[key] = build_schedule(name, p, m, v, check=False)
            except ValueError as e:  # remembered: every layout with these sizes fails the same way
                self._lists[key] = e
        if proved and key not in self._proved and not isinstance(self._lists[key], ValueError):
            try:
                validate(self._lists[key], m)
                self._proved.add(key)
            except ValueError as e:
                self._lists[key] = e
        if isinstance(self._lists[key], ValueError):
            raise self._lists[key].with_traceback(None)
        return self._lists[key]

    def in_flight(self, name: str, p: int, m: int, v: int) -> list[int]:
        """Most (microbatch, stage) activations alive at once on each rank, a microbatch counted
        until its ``W`` (:func:`~paratron.pipeline.actions.activation_peak` of its list)."""
        return [max(a + w for a, w in states) for states in self.flight(name, p, m, v)]

    def flight(self, name: str, p: int, m: int, v: int) -> list[Flight]:
        """:func:`flight_states` of each rank's list, once per (schedule, p, m, v)."""
        key = (name, p, m, v)
        if key not in self._flights:
            self._flights[key] = [flight_states(acts) for acts in self.lists(name, p, m, v, proved=False)]
        return self._flights[key]


def flight_states(actions: list[Action]) -> Flight:
    """The ``(alive, pending)`` counts one rank's list reaches that no other reached point beats
    in both, in list order: a (microbatch, stage) is *alive* from its ``F`` (its ``R`` when it is
    recomputed, as :func:`~paratron.pipeline.actions.activation_peak` counts) to the end of its
    ``B`` or ``BW``, and *pending* from the end of its ``B`` to its ``W``. The memory of any
    point, ``alive x held + pending x deferred`` with both sizes positive, peaks at one of these.
    Schedules without a separate ``W`` give one pair ``(peak, 0)``."""
    again = recomputed(actions)
    alive = pending = 0
    seen = {(0, 0)}
    for a in expand(actions):
        if a.kind == "R" or a.kind == "F" and (a.microbatch, a.stage) not in again:
            alive += 1
        elif a.kind in ("B", "BW"):
            alive -= 1
            pending += a.kind == "B"
        elif a.kind == "W":
            pending -= 1
        else:
            continue
        seen.add((alive, pending))
    return tuple(sorted(s for s in seen if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in seen)))


def makespan(lists: list[list[Action]], works: list[Work], p2p_seconds: float, sharing: float = 1.0
             ) -> PipelineCost:
    """Simulate ``lists`` with ``works[stage]`` seconds per action and ``p2p_seconds`` per message.

    ``works`` are seconds with every rank computing at once. When ranks share cores (``sharing`` > 1,
    a CPU), a rank waiting in a bubble lends its share to the others: the step is then the longer
    of the critical path at the faster lone-rank speed (the simulation with ``works / sharing``)
    and the total work spread over all ranks (the mean busy time at the shared speed). With one
    device per rank (``sharing`` = 1) this is the simulated makespan.

    Raises:
        ScheduleError: the lists deadlock (from the simulator).
    """
    def plain(a: Action) -> float:
        w = works[a.stage]
        return {"F": w.F, "B": w.B, "W": w.W, "BW": w.B + w.W}[a.kind] / sharing

    def cost(a: Action) -> float:
        # An FB pair (DualPipeV, F/B overlap) costs its two halves: the planner models no MoE
        # communication for the pair to hide, so nothing of it overlaps.
        return sum(plain(h) for h in halves(a))

    r = simulate(lists, cost, latency=p2p_seconds)
    busy = [b * sharing for b in r.busy]
    span = max(r.makespan, sum(busy) / len(busy))
    bubble = sum(1 - b / span for b in busy) / len(busy)
    return PipelineCost(span, bubble, tuple(busy))
