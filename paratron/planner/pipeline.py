"""Pipeline makespan, bubble and in-flight microbatches, from the schedule's own action lists.

The lists come from :func:`paratron.pipeline.registry.build_schedule` (the ones the runtime runs);
:func:`paratron.pipeline.simulator.simulate` executes them with each action's seconds from
:mod:`.compute` and the stage-boundary p2p time as latency. The peak number of microbatch
activations a rank holds depends only on the order of its own list (+1 at F, -1 at BW or W), so it
is read from the lists directly, before any costing (it bounds memory, Korthikanti et al. 2022,
section 4.2: 1F1B keeps ``p - r`` microbatches on rank ``r``, GPipe all ``m``).
"""

from __future__ import annotations

from dataclasses import dataclass

from paratron.pipeline.actions import Action
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.simulator import simulate

from .compute import Work


@dataclass(frozen=True)
class PipelineCost:
    """Makespan (s) of one step's schedule, mean bubble fraction over ranks, per-rank busy time."""

    makespan: float
    bubble: float
    busy: tuple[float, ...]


class ScheduleCache:
    """Action lists and per-rank peak in-flight counts, built once per (schedule, p, m, v).

    The lists are built with ``check=True``: proving them is the validator's schedule rule, which
    enumeration defers to here (:mod:`.layouts`); a failing schedule raises ``ValueError``.
    """

    def __init__(self) -> None:
        self._lists: dict[tuple[str, int, int, int], list[list[Action]]] = {}

    def lists(self, name: str, p: int, m: int, v: int) -> list[list[Action]]:
        key = (name, p, m, v)
        if key not in self._lists:
            self._lists[key] = build_schedule(name, p, m, v)
        return self._lists[key]

    def in_flight(self, name: str, p: int, m: int, v: int) -> list[int]:
        """Most (microbatch, stage) activations alive at once on each rank."""
        out = []
        for acts in self.lists(name, p, m, v):
            alive = peak = 0
            for a in acts:
                if a.kind == "F":
                    alive += 1
                    peak = max(peak, alive)
                elif a.kind in ("BW", "W"):
                    alive -= 1
            out.append(peak)
        return out


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
    def cost(a: Action) -> float:
        w = works[a.stage]
        return {"F": w.F, "B": w.B, "W": w.W, "BW": w.B + w.W}[a.kind] / sharing

    r = simulate(lists, cost, latency=p2p_seconds)
    busy = [b * sharing for b in r.busy]
    span = max(r.makespan, sum(busy) / len(busy))
    bubble = sum(1 - b / span for b in busy) / len(busy)
    return PipelineCost(span, bubble, tuple(busy))
