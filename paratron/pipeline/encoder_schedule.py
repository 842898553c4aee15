"""Place a multimodal encoder's work into a pipeline schedule (Optimus; Feng et al., USENIX ATC
2025).

A vision-language model feeds stage 0 with the encoder's output for each microbatch. Megatron runs
the encoder inside stage 0 (placement ``"stage0"``), so stage 0's rank carries the whole encoder
and every other rank waits on it. Optimus keeps an encoder replica on every pipeline rank and runs
encoder forward and backward work in the LLM schedule's bubbles (placement ``"optimus"``); the
encoder outputs travel to stage 0 and their grads come back.

:func:`place_encoder` takes any pipeline schedule (1F1B, interleaved, zero-bubble, DualPipeV: a
list of :class:`~paratron.pipeline.actions.Action` per rank) and returns it with, for each
microbatch ``mb`` and each of ``parts`` parts of its images:

* ``EF(mb, k)`` and ``EB(mb, k)`` on the rank that owns the part;
* when that rank is not stage 0's: ``SEND_E`` after the ``EF``, ``RECV_E`` on stage 0's rank
  right before ``F(mb, 0)``, ``SEND_EG`` right after the backward of ``(mb, 0)``, and
  ``RECV_EG`` right before the ``EB``.

The two dependency rules (encoder forward ``mb`` before stage 0's forward ``mb``; encoder
backward ``mb`` after stage 0's backward ``mb``) hold by construction and are proved by
:func:`~paratron.pipeline.validate.validate`.

Optimus placement, by the simulator's costs (:class:`~paratron.pipeline.simulator.Costs` with
``EF``/``EB``): the parts are placed one at a time, in microbatch order. For each rank, the
part's ``EF`` goes into the *gap* (the place between two compute actions of a rank, after the
earlier one's sends) where the simulated step is shortest, then its ``EB`` into the best gap
after it on the same rank (its graph is there); the part goes to the rank whose pair gives the
shortest step, ties broken by the summed finish times of the ranks and then by the ``EB``'s end.
Each rank runs its ``EF``'s and its ``EB``'s in microbatch order, so the encoder messages between
two ranks come in the same order on both sides. Parts that fit a bubble do not lengthen the
step; the rest are spread over the ranks. Only the gaps :func:`_candidates` lists are simulated
(those with idle time at a useful moment, and the ends of the allowed range).
"""

from __future__ import annotations

from dataclasses import replace

from .actions import EB, EF, Action, halves, stages_of
from .simulator import Costs, simulate
from .validate import ScheduleError

PLACEMENTS = ("stage0", "optimus")


def place_encoder(schedule: list[list[Action]], placement: str, costs: Costs, parts: int | None = None,
                  ) -> list[list[Action]]:
    """The schedule with the encoder's actions placed.

    Args:
        schedule: one complete action list per pipeline rank (from ``build_schedule``), without
            encoder actions.
        placement: ``"stage0"`` (every part on stage 0's rank, ``EF`` right before stage 0's
            ``F``, ``EB`` right after its backward: Megatron) or ``"optimus"`` (the greedy above).
        costs: the simulator's costs, with ``EF`` and ``EB`` per microbatch.
        parts: parts per microbatch (default ``costs.encoder_parts``); each part is one
            ``EF``/``EB`` pair that any rank may own.

    Returns:
        New lists, one per rank.

    Raises:
        ValueError: an unknown placement, ``parts < 1``, or a schedule that already has encoder
            actions.
    """
    parts = costs.encoder_parts if parts is None else parts
    if placement not in PLACEMENTS:
        raise ValueError(f"parallel.encoder_placement={placement!r} must be one of {', '.join(PLACEMENTS)}")
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"encoder parts={parts!r} must be a positive integer")
    if any(a.is_encoder for acts in schedule for a in acts):
        raise ValueError("place_encoder takes a schedule without encoder actions")
    costs = replace(costs, encoder_parts=parts)
    plan = _Plan(schedule)
    m = 1 + max(a.microbatch for acts in schedule for a in acts)
    if placement == "stage0":
        for mb in range(m):
            for k in range(parts):
                plan.add(plan.r0, plan.stage0_gap("F", mb), EF(mb, k))
                plan.add(plan.r0, plan.stage0_gap("B", mb), EB(mb, k))
        return plan.lists()
    for mb in range(m):
        for k in range(parts):
            _place_part(plan, mb, k, costs)
    return plan.lists()


def _place_part(plan: "_Plan", mb: int, k: int, costs: Costs) -> None:
    """Place ``EF(mb, k)`` and ``EB(mb, k)`` on the rank where, each in its best gap there, the
    simulated step is shortest."""
    best, now = None, simulate(plan.lists(), costs)
    for r in range(len(plan.base)):
        f = _best_gap(plan, EF(mb, k), costs, r, now)
        if f is None:
            continue
        plan.add(r, f[1], EF(mb, k))
        b = _best_gap(plan, EB(mb, k), costs, r, simulate(plan.lists(), costs))
        plan.remove(r, f[1], EF(mb, k))
        if b is not None and (best is None or b[0] < best[0]):
            best = (b[0], r, f[1], b[1])
    if best is None:
        raise ValueError(f"no place for part {k} of microbatch {mb} in the schedule")
    _, r, f, b = best
    plan.add(r, f, EF(mb, k))
    plan.add(r, b, EB(mb, k))


def _best_gap(plan: "_Plan", item: Action, costs: Costs, r: int, now):
    """(score, gap) of the gap of rank r where ``item`` makes the shortest simulated step (see the
    module docstring), among those :func:`_candidates` lists for the current timeline ``now``;
    None if the item can run in none."""
    best = None
    for gap in _candidates(plan, now, r, item):
        plan.add(r, gap, item)
        try:
            result = simulate(plan.lists(), costs)
        except ScheduleError:  # e.g. the part is sent after a wait that needs it
            result = None
        plan.remove(r, gap, item)
        if result is None:
            continue
        end = next(s.end for s in result.spans[r] if s.action == item)
        score = (round(result.makespan, 9), round(sum(max(s.end for s in rs) for rs in result.spans if rs), 9), end)
        if best is None or score < best[0]:
            best = (score, gap)
    return best


def _candidates(plan: "_Plan", now, r: int, item: Action) -> list[int]:
    """The gaps of rank r worth simulating for ``item``, from the current timeline ``now``: those
    with idle time when the item can use it (an ``EF`` before stage 0 needs its output, an
    ``EB`` after stage 0 made its grad), the last gap before that need (``EF``) or the first
    after the grad (``EB``), and the range's ends."""
    allowed = plan.gaps(r, item)
    computes = [s for s in now.spans[r] if not (s.action.is_p2p or s.action.is_encoder)]
    opens = [0.0] + [s.end for s in computes]
    closes = [s.start for s in computes] + [now.makespan]
    busy = [sum(s.end - s.start for s in now.spans[r] if s.action in items) for items in plan.items[r]]
    idle = [c - o - b for o, c, b in zip(opens, closes, busy)]
    stage0 = [s for s in now.spans[plan.r0] if not s.action.is_encoder
              and any(h.stage == 0 and h.microbatch == item.microbatch and h.kind == ("F" if item.kind == "EF" else
                      h.kind) and h.kind in ("F", "B", "BW") for h in halves(s.action))]
    if item.kind == "EF":
        need = min(s.start for s in stage0 if s.action.kind in ("F", "FB"))
        usable = [g for g in allowed if opens[g] < need]
        pick = {g for g in usable if idle[g] > 1e-9} | {usable[-1]} if usable else set()
    else:
        ready = max(s.end for s in stage0 if s.action.kind != "F")
        usable = [g for g in allowed if closes[g] > ready]
        pick = {g for g in usable if idle[g] > 1e-9} | ({usable[0]} if usable else set())
    return sorted(pick | {allowed[0], allowed[-1]})


class _Plan:
    """The base lists, the encoder items placed in their gaps, and the lists they make."""

    def __init__(self, schedule: list[list[Action]]):
        self.base = schedule
        self.r0 = next(r for r, acts in enumerate(schedule) if 0 in stages_of(acts))
        self.inserts = [_gap_indices(acts) for acts in schedule]
        self.items: list[list[list[Action]]] = [[[] for _ in ins] for ins in self.inserts]
        self.owner: dict[tuple[int, int], int] = {}
        self.backward: set[tuple[int, int]] = set()  # parts whose EB is placed (their grads travel)

    def num_gaps(self, r: int) -> int:
        return len(self.inserts[r])

    def gaps(self, r: int, item: Action) -> range:
        """The gaps of rank r where ``item`` may go: after the rank's items of its kind (their
        order), an ``EB`` after its ``EF``; on stage 0's rank an ``EF`` before ``F(mb, 0)`` and an
        ``EB`` after the backward of ``(mb, 0)`` (the local data dependencies)."""
        first = max((g for g, items in enumerate(self.items[r]) if any(a.kind == item.kind for a in items)),
                    default=0)
        last = self.num_gaps(r) - 1
        if item.kind == "EB":
            first = max(first, next(g for g, items in enumerate(self.items[r])
                                    if any(a.kind == "EF" and a.microbatch == item.microbatch and a.part == item.part
                                           for a in items)))
        if r == self.r0 and item.kind == "EF":
            last = min(last, self.stage0_gap("F", item.microbatch))
        elif r == self.r0:
            first = max(first, self.stage0_gap("B", item.microbatch))
        return range(first, last + 1)

    def stage0_gap(self, kind: str, mb: int) -> int:
        """The gap right before ``F(mb, 0)`` (kind "F") or right after the backward of (mb, 0)."""
        computes = [a for a in self.base[self.r0] if not a.is_p2p]
        for j, a in enumerate(computes):
            for h in halves(a):
                if h.stage == 0 and h.microbatch == mb and (h.kind == "F") == (kind == "F") and h.kind != "W":
                    return j if kind == "F" else j + 1
        raise ValueError(f"stage 0's rank has no {'F' if kind == 'F' else 'backward'} of microbatch {mb}")

    def add(self, r: int, gap: int, item: Action) -> None:
        self.items[r][gap].append(item)
        if item.kind == "EF":
            self.owner[(item.microbatch, item.part)] = r
        else:
            self.backward.add((item.microbatch, item.part))

    def remove(self, r: int, gap: int, item: Action) -> None:
        self.items[r][gap].remove(item)
        if item.kind == "EF":
            del self.owner[(item.microbatch, item.part)]
        else:
            self.backward.discard((item.microbatch, item.part))

    def lists(self) -> list[list[Action]]:
        """The complete lists: the items at their gaps, with their messages."""
        out = []
        for r, acts in enumerate(self.base):
            at = dict(zip(self.inserts[r], self.items[r]))
            new: list[Action] = []
            for i in range(len(acts) + 1):
                for item in at.get(i, ()):
                    new += self._with_messages(r, item)
                if i < len(acts):
                    new += self._around_stage0(r, acts[i])
            out.append(new)
        return out

    def _with_messages(self, r: int, item: Action) -> list[Action]:
        o = self.owner.get((item.microbatch, item.part), r)
        if o == self.r0:
            return [item]
        if item.kind == "EF":
            return [item, Action("SEND_E", item.microbatch, 0, self.r0, part=item.part)]
        return [Action("RECV_EG", item.microbatch, 0, self.r0, part=item.part), item]

    def _around_stage0(self, r: int, a: Action) -> list[Action]:
        """``a`` with stage 0's encoder receives before it and grad sends after it."""
        if r != self.r0 or a.is_p2p:
            return [a]
        before, after = [], []
        for h in halves(a):
            if h.stage != 0 or h.kind == "W":
                continue
            kind = "RECV_E" if h.kind == "F" else "SEND_EG"
            remote = sorted(k for (mb, k), o in self.owner.items() if mb == h.microbatch and o != self.r0
                            and (kind == "RECV_E" or (mb, k) in self.backward))
            msgs = [Action(kind, h.microbatch, 0, self.owner[(h.microbatch, k)], part=k) for k in remote]
            (before if h.kind == "F" else after).extend(msgs)
        return before + [a] + after


def _gap_indices(acts: list[Action]) -> list[int]:
    """For each gap of one rank's list (before its first compute action, between two, after the
    last), the list index where encoder items go: after the earlier action's sends, before the
    receives of the next."""
    computes = [i for i, a in enumerate(acts) if not a.is_p2p]
    out = [0]
    for i in computes:
        j = i + 1
        while j < len(acts) and acts[j].kind.startswith("SEND"):
            j += 1
        out.append(j)
    return out
