"""Check action lists without processes: completeness, local order, matched p2p, no deadlock.

Batched p2p semantics (what the runtime does, and what the simulator costs):

* A *batch* is a maximal run of consecutive SEND/RECV actions in one rank's list. The rank posts
  all of them at once (``batch_isend_irecv``) and then waits for the batch's receives only.
* A send never blocks its rank: it is posted and completes in the background (the runtime waits
  for outstanding sends at the end of the schedule).
* Messages between an ordered pair of ranks match in order: the k-th send from rank a to rank b is
  the k-th receive on b from a (as gloo and NCCL match p2p with one tag). Its content must agree:
  ``SEND_F(mb, s)`` pairs with ``RECV_F(mb, s+1)`` and ``SEND_B(mb, s)`` with ``RECV_B(mb, s-1)``.
* A receive completes once its matching send has been posted.

* Encoder messages (``SEND_E``/``RECV_E``/``SEND_EG``/``RECV_EG``) form a second stream per
  ordered pair of ranks (:func:`~paratron.pipeline.actions.channel`; the runtime gives them their
  own tag): they match in order among themselves, independently of the stages' messages.

Under these rules a set of lists deadlocks only if receives wait on each other in a cycle; the
executor below runs the lists and reports the ranks that cannot move.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from .actions import Action, activation_peak, batches, channel, halves, recomputed, stages_of


class ScheduleError(ValueError):
    """An action list that the runtime could not run; the message names the rank and the rule."""


@dataclass(frozen=True)
class Span:
    """One executed action: ``start`` and ``end`` in the cost unit (seconds, or abstract units)."""

    rank: int
    action: Action
    start: float
    end: float


def _message_key(a: Action) -> tuple[str, int, int]:
    """What a send carries, keyed by its sending stage: ("F"|"B", microbatch, sender stage); an
    encoder message by its part: ("E"|"G", microbatch, part) for an output or its grad."""
    if a.is_encoder:
        return ("G" if a.kind.endswith("EG") else "E", a.microbatch, a.part)
    if a.kind == "SEND_F" or a.kind == "SEND_B":
        return (a.kind[-1], a.microbatch, a.stage)
    if a.kind == "RECV_F":
        return ("F", a.microbatch, a.stage - 1)
    return ("B", a.microbatch, a.stage + 1)


def execute(schedule: list[list[Action]], cost: Callable[[Action], float] = lambda a: 0.0,
            latency: float | Callable[[int, int], float] = 0.0) -> list[list[Span]]:
    """Run the lists under the batched p2p semantics above and time every action.

    Args:
        schedule: one action list per pipeline rank.
        cost: duration of a compute action (p2p actions take no rank time of their own).
        latency: time from posting a send until the message can be received; or a function
            ``(src_rank, dst_rank) -> time`` for a cost per link.

    Returns:
        For each rank, its actions as :class:`Span` in execution order. A batch's actions all span
        from the batch's post time to the arrival of its last received message.

    Raises:
        ScheduleError: a deadlock (naming each stuck rank and the receive it waits for), a message
            whose content differs from what the receiver expects, or sends never received.
    """
    link = latency if callable(latency) else (lambda src, dst: latency)
    steps = [batches(acts) for acts in schedule]
    ptr = [0] * len(schedule)
    clock = [0.0] * len(schedule)
    spans: list[list[Span]] = [[] for _ in schedule]
    posted_at: dict[tuple[int, int], list[tuple[tuple[str, int, int], float]]] = defaultdict(list)
    received: dict[tuple[int, int], int] = defaultdict(int)
    waiting: dict[int, list[tuple[Action, int]]] = {}  # rank -> posted recvs and their indices
    while True:
        moved = False
        for r, rank_steps in enumerate(steps):
            while ptr[r] < len(rank_steps):
                step = rank_steps[ptr[r]]
                if not step[0].is_p2p:
                    a = step[0]
                    spans[r].append(Span(r, a, clock[r], clock[r] + float(cost(a))))
                    clock[r] = spans[r][-1].end
                    ptr[r] += 1
                    moved = True
                    continue
                if r not in waiting:
                    recvs = []
                    for a in step:
                        if a.kind.startswith("SEND"):
                            posted_at[(r, a.peer, channel(a))].append((_message_key(a), clock[r]))
                        else:
                            recvs.append((a, received[(a.peer, r, channel(a))]))
                            received[(a.peer, r, channel(a))] += 1
                    waiting[r] = recvs
                    moved = True
                arrivals = []
                for a, idx in waiting[r]:
                    queue = posted_at[(a.peer, r, channel(a))]
                    if idx >= len(queue):
                        break
                    key, t = queue[idx]
                    if key != _message_key(a):
                        raise ScheduleError(
                            f"rank {r}: {a} is matched with message #{idx} from rank {a.peer}, which carries "
                            f"{key[0]} of microbatch {key[1]} from stage {key[2]}; sends and receives between "
                            "two ranks must come in the same order")
                    arrivals.append(t + link(a.peer, r))
                else:
                    end = max([clock[r]] + arrivals)
                    spans[r].extend(Span(r, a, clock[r], end) for a in step)
                    clock[r] = end
                    del waiting[r]
                    ptr[r] += 1
                    moved = True
                    continue
                break
        if all(ptr[r] == len(steps[r]) for r in range(len(steps))):
            break
        if not moved:
            stuck = []
            for r in range(len(steps)):
                if ptr[r] < len(steps[r]):
                    pending = [str(a) for a, idx in waiting.get(r, [])
                               if idx >= len(posted_at[(a.peer, r, channel(a))])]
                    stuck.append(f"rank {r} waits at step {ptr[r]} for {', '.join(pending) or steps[r][ptr[r]]}")
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    for (src, dst, chan), queue in posted_at.items():
        if len(queue) != received[(src, dst, chan)]:
            extra = [f"{k[0]}{k[1]}@s{k[2]}" for k, _ in queue[received[(src, dst, chan)]:]]
            raise ScheduleError(f"rank {src} sends {len(queue)} {chan} messages to rank {dst}, which receives only "
                                f"{received[(src, dst, chan)]}; never received: {', '.join(extra)}")
    return spans


def validate(schedule: list[list[Action]], num_microbatches: int | None = None, *,
             forward_only: bool = False, memory_budget: int | None = None) -> list[list[Span]]:
    """Prove that a schedule can run: every rank's list is complete and locally ordered, every
    received tensor is sent (and every sent one received) in matching order, and the batched p2p
    execution finishes (no deadlock).

    Rules checked, per rank r:
      * each stage is held by one rank, and the stages are ``0 .. S-1``;
      * each (microbatch, stage) of the rank has exactly one ``F`` and, unless ``forward_only``,
        exactly one ``BW`` or one ``B`` followed later by one ``W``; ``W``'s of a stage come in the
        order of its ``B``'s (the weight-grad store is a queue);
      * ``F(mb, s>0)`` comes after ``F(mb, s-1)`` on the same rank or after ``RECV_F(mb, s)``;
        a backward of ``(mb, s)`` after ``F(mb, s)`` and after the backward of ``(mb, s+1)`` on the
        same rank or ``RECV_B(mb, s)``; a send after the action that makes its tensor;
      * the peer of every send/recv is the rank that holds the neighbouring stage;
      * an ``R(mb, s)`` (recompute) comes after ``F(mb, s)`` and before its backward, at most once;
      * an ``FB`` pair: both halves obey the rules above at the pair's place, neither depending on
        the other (its backward is not of the forward's microbatch and stage, nor waits on it);
      * with ``memory_budget``, the peak in-flight activations of every rank
        (:func:`~paratron.pipeline.actions.activation_peak`) are at most the budget;
      * encoder actions (:func:`_check_encoder`): each part of each microbatch has one ``EF`` and
        one ``EB`` on one rank; ``F(mb, 0)`` comes after every part of ``mb`` (its ``EF`` on stage
        0's rank or its ``RECV_E``), and ``EB(mb, k)`` after the backward of ``(mb, 0)`` (on stage
        0's rank, or after its ``RECV_EG``), with the sends after what makes their tensors.

    Returns:
        The zero-cost execution (:func:`execute`), which callers may ignore.

    Raises:
        ScheduleError: the first rule broken, naming the rank and the action.
    """
    owner: dict[int, int] = {}
    for r, acts in enumerate(schedule):
        for s in stages_of(acts):
            if owner.setdefault(s, r) != r:
                raise ScheduleError(f"stage {s} appears on ranks {owner[s]} and {r}; a stage lives on one rank")
    num_stages = len(owner)
    if sorted(owner) != list(range(num_stages)):
        raise ScheduleError(f"stages {sorted(owner)} must be numbered 0 .. {num_stages - 1} without gaps")
    if num_microbatches is None:
        num_microbatches = 1 + max((a.microbatch for acts in schedule for a in acts), default=-1)
    last = num_stages - 1
    for r, acts in enumerate(schedule):
        _check_rank(r, acts, owner, last, num_microbatches, forward_only)
    _check_encoder(schedule, owner[0] if owner else 0, num_microbatches, forward_only)
    for r, acts in enumerate(schedule):
        if memory_budget is not None and activation_peak(acts) > memory_budget:
            raise ScheduleError(f"rank {r}: {activation_peak(acts)} activations in flight at the peak exceed "
                                f"memory_budget={memory_budget}")
    return execute(schedule)


def _check_rank(r: int, acts: list[Action], owner: dict[int, int], last: int, m: int,
                forward_only: bool) -> None:
    seen: dict[tuple[str, int, int], int] = {}
    b_order: dict[int, list[int]] = defaultdict(list)
    w_order: dict[int, list[int]] = defaultdict(list)
    again = recomputed(acts)

    def fail(i: int, a, rule: str) -> None:
        raise ScheduleError(f"rank {r}, action #{i} {a}: {rule}")

    def has(kind: str, mb: int, s: int) -> bool:
        return (kind, mb, s) in seen

    def backward_done(mb: int, s: int) -> bool:
        return has("B", mb, s) or has("BW", mb, s)

    def check(i: int, a: Action, shown: Action) -> None:
        """The rules for one plain action ``a`` (``shown``: the list's action, an FB for a half)."""
        label = a if shown is a else f"{shown} (its half {a})"
        mb, s = a.microbatch, a.stage
        if mb >= m:
            fail(i, label, f"microbatch {mb} is out of range [0, {m})")
        if a.is_p2p:
            if a.peer == r:
                fail(i, label, "a rank does not send to itself; stages on one rank pass tensors locally")
            nbr = s + 1 if a.kind in ("SEND_F", "RECV_B") else s - 1
            if nbr < 0 or nbr > last or owner[nbr] != a.peer:
                fail(i, label, f"the peer must be the rank of stage {nbr} "
                           f"({owner.get(nbr, 'no such stage')}), not {a.peer}")
        key = (a.kind, mb, s)
        if key in seen:
            fail(i, label, f"duplicate: first at action #{seen[key]}")
        if a.kind == "F":
            if s > 0 and not (has("F", mb, s - 1) if owner[s - 1] == r else has("RECV_F", mb, s)):
                fail(i, label, f"its input is not there yet: needs F({mb}, stage {s - 1}) on this rank "
                           f"or RECV_F({mb}, stage {s}) first")
        elif a.kind in ("B", "BW"):
            if forward_only:
                fail(i, label, "a forward-only list has no backward")
            if backward_done(mb, s):
                fail(i, label, "a second backward of the same microbatch and stage")
            if not has("F", mb, s):
                fail(i, label, "backward before its forward")
            if (mb, s) in again and not has("R", mb, s):
                fail(i, label, f"backward before its recompute R({mb}, stage {s})")
            if s < last and not (backward_done(mb, s + 1) if owner[s + 1] == r else has("RECV_B", mb, s)):
                fail(i, label, f"its output grad is not there yet: needs the backward of stage {s + 1} "
                           f"on this rank or RECV_B({mb}, stage {s}) first")
            if a.kind == "B":
                b_order[s].append(mb)
        elif a.kind == "R":
            if forward_only:
                fail(i, label, "a forward-only list has no recompute")
            if not has("F", mb, s):
                fail(i, label, "recompute before its forward")
        elif a.kind == "W":
            if not has("B", mb, s):
                fail(i, label, "W before its B")
            w_order[s].append(mb)
            if w_order[s] != b_order[s][:len(w_order[s])]:
                fail(i, label, f"W's of stage {s} must follow the order of its B's {b_order[s]}")
        elif a.kind == "SEND_F" and not has("F", mb, s):
            fail(i, label, "sends an activation before computing it")
        elif a.kind == "SEND_B" and not backward_done(mb, s):
            fail(i, label, "sends a grad before computing it")
        elif a.kind == "SEND_B" and s == 0 or a.kind == "RECV_F" and s == 0:
            fail(i, label, "stage 0 has no previous stage")

    for i, a in enumerate(acts):
        if a.is_encoder:  # checked across ranks by _check_encoder
            continue
        # An FB pair runs its halves interleaved: each must be ready before the pair starts, so
        # neither may depend on the other (both are checked before either counts as done).
        parts = halves(a)
        if a.kind == "FB" and parts[1].microbatch == a.microbatch and parts[1].stage == a.stage:
            fail(i, a, "an FB pair needs two independent halves; the backward of the same microbatch "
                       "and stage must come after its forward")
        for h in parts:
            check(i, h, a)
        for h in parts:
            seen[(h.kind, h.microbatch, h.stage)] = i
    for s in (s for s, o in owner.items() if o == r):
        for mb in range(m):
            if not has("F", mb, s):
                raise ScheduleError(f"rank {r}: F({mb}, stage {s}) is missing")
            if forward_only:
                continue
            if has("BW", mb, s) == has("B", mb, s):
                raise ScheduleError(f"rank {r}: microbatch {mb} of stage {s} needs exactly one BW or one B + W")
            if has("B", mb, s) and not has("W", mb, s):
                raise ScheduleError(f"rank {r}: B({mb}, stage {s}) has no W; the weight grads would be lost")


def _check_encoder(schedule: list[list[Action]], r0: int, m: int, forward_only: bool) -> None:
    """The encoder rules (Optimus, Feng et al. 2025: encoder forward ``m`` before stage
    0's forward ``m``, encoder backward ``m`` after stage 0's backward ``m``); ``r0`` holds stage 0.
    A list set without encoder actions passes."""
    owner: dict[tuple[int, int], int] = {}
    for r, acts in enumerate(schedule):
        for i, a in enumerate(acts):
            if a.kind == "EF" and owner.setdefault((a.microbatch, a.part), r) != r:
                raise ScheduleError(f"rank {r}, action #{i} {a}: part {a.part} of microbatch {a.microbatch} "
                                    f"already has its EF on rank {owner[(a.microbatch, a.part)]}")
    if not owner and not any(a.is_encoder for acts in schedule for a in acts):
        return
    parts = 1 + max((k for _, k in owner), default=0)
    for mb in range(m):
        for k in range(parts):
            if (mb, k) not in owner:
                raise ScheduleError(f"EF({mb}, part {k}) is missing: every microbatch has {parts} encoder parts")
    for r, acts in enumerate(schedule):
        _check_encoder_rank(r, acts, r0, owner, parts, m, forward_only)


def _check_encoder_rank(r: int, acts: list[Action], r0: int, owner: dict[tuple[int, int], int], parts: int,
                        m: int, forward_only: bool) -> None:
    seen: set[tuple[str, int, int]] = set()

    def fail(i: int, a, rule: str) -> None:
        raise ScheduleError(f"rank {r}, action #{i} {a}: {rule}")

    def here(mb: int, k: int) -> bool:  # the encoder output of (mb, k) is on this rank
        return ("EF", mb, k) in seen if owner[(mb, k)] == r else ("RECV_E", mb, k) in seen

    def stage0_backward(mb: int) -> bool:
        return ("B", mb, -1) in seen or ("BW", mb, -1) in seen

    for i, a in enumerate(acts):
        for h in halves(a):
            if not h.is_encoder:
                if h.stage == 0 and h.kind == "F" and not all(here(h.microbatch, k) for k in range(parts)):
                    fail(i, a, f"F({h.microbatch}, stage 0) needs every encoder part of microbatch "
                               f"{h.microbatch} first (its EF on this rank or its RECV_E)")
                if h.stage == 0 and h.kind in ("B", "BW"):
                    seen.add((h.kind, h.microbatch, -1))
                continue
            mb, k = h.microbatch, h.part
            if mb >= m or k >= parts:
                fail(i, a, f"microbatch {mb} / part {k} out of range [0, {m}) / [0, {parts})")
            key = (h.kind, mb, k)
            if key in seen:
                fail(i, a, "duplicate")
            mine, remote = owner[(mb, k)] == r, owner[(mb, k)] != r0
            if h.kind in ("SEND_E", "RECV_EG", "EB", "EF") and not mine:
                fail(i, a, f"part {k} of microbatch {mb} lives on rank {owner[(mb, k)]} (its EF)")
            if h.kind in ("RECV_E", "SEND_EG") and r != r0:
                fail(i, a, f"only stage 0's rank {r0} receives encoder outputs and sends their grads")
            if h.is_p2p and (not remote or h.peer != (r0 if mine else owner[(mb, k)])):
                fail(i, a, f"the peer must be rank {r0 if mine else owner[(mb, k)]}, and a part on stage 0's "
                           "rank needs no message")
            if h.kind == "SEND_E" and ("EF", mb, k) not in seen:
                fail(i, a, "sends an encoder output before its EF")
            if h.kind == "SEND_EG" and not stage0_backward(mb):
                fail(i, a, f"sends the grad of the encoder output before the backward of ({mb}, stage 0)")
            if h.kind == "EB" and not (("RECV_EG", mb, k) in seen if remote else stage0_backward(mb)):
                fail(i, a, f"encoder backward before the grad of its output: needs the backward of ({mb}, "
                           "stage 0) on this rank or RECV_EG first")
            seen.add(key)
    _check_encoder_complete(r, seen, r0, owner, forward_only)


def _check_encoder_complete(r: int, seen: set, r0: int, owner: dict[tuple[int, int], int],
                            forward_only: bool) -> None:
    for (mb, k), o in owner.items():
        need = []
        if o == r:
            need += [] if forward_only else ["EB"]
            need += [] if o == r0 else ["SEND_E"] + ([] if forward_only else ["RECV_EG"])
        elif r == r0:
            need += ["RECV_E"] + ([] if forward_only else ["SEND_EG"])
        for kind in need:
            if (kind, mb, k) not in seen:
                raise ScheduleError(f"rank {r}: {kind}({mb}, part {k}) is missing")
