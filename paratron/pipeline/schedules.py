"""The built-in pipeline schedules, as pure functions ``(p, m, v) -> list[list[Action]]``.

Each schedule writes the order of compute actions (F, B, W, BW) on every rank; :func:`with_p2p`
then inserts the sends and receives. Sends go right after the action that produced the tensor;
a receive goes right before the action that consumes it, together with any earlier message from
the same peer that is still unreceived (messages between two ranks match in order, so a rank
receives them in the order its peer sent them). Sends never block (:mod:`.validate`), so these
lists cannot deadlock as long as the compute orders respect the data dependencies, which the
validator checks.

Notation below: ``p`` pipeline ranks, ``m`` microbatches, ``v`` virtual stages (model chunks) per
rank, rank ``r`` in ``[0, p)``.
"""

from __future__ import annotations

from collections import defaultdict

from .actions import Action, B, BW, F, W, halves
from .placement import loop_placement, rank_of_stage, v_placement


def with_p2p(compute: list[list[Action]]) -> list[list[Action]]:
    """Insert SEND/RECV actions into per-rank compute orders.

    Args:
        compute: for each pipeline rank, its F/B/W/BW (and FB) actions in execution order. The rank
            that runs ``F(mb, s)`` owns stage ``s``; stages must be ``0 .. S-1``. An ``FB`` pair
            receives the inputs of both halves before it and sends both outputs after it.

    Returns:
        One complete action list per rank.

    Raises:
        ValueError: a stage is run by two ranks, or a needed message is never produced.
    """
    owner: dict[int, int] = {}
    for r, acts in enumerate(compute):
        for a in acts:
            if a.is_p2p:
                raise ValueError(f"with_p2p takes compute actions only; rank {r} has {a}")
            for h in halves(a):
                if owner.setdefault(h.stage, r) != r:
                    raise ValueError(f"stage {h.stage} appears on ranks {owner[h.stage]} and {r}")
    num_stages = max(owner) + 1 if owner else 0

    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = defaultdict(list)
    with_sends: list[list[Action]] = []
    for r, acts in enumerate(compute):
        out: list[Action] = []
        for pair in acts:
            out.append(pair)
            for a in halves(pair):  # an FB sends both halves' outputs after the pair
                if a.kind == "F" and a.stage + 1 < num_stages and owner[a.stage + 1] != r:
                    dst = owner[a.stage + 1]
                    out.append(Action("SEND_F", a.microbatch, a.stage, dst))
                    sent[(r, dst)].append(("F", a.microbatch, a.stage))
                elif a.kind in ("B", "BW") and a.stage > 0 and owner[a.stage - 1] != r:
                    dst = owner[a.stage - 1]
                    out.append(Action("SEND_B", a.microbatch, a.stage, dst))
                    sent[(r, dst)].append(("B", a.microbatch, a.stage))
        with_sends.append(out)

    result: list[list[Action]] = []
    for r, acts in enumerate(with_sends):
        posted: dict[int, int] = defaultdict(int)  # per source rank: messages already received
        out = []
        for pair in acts:
            for need in _inputs_from_peers(pair, owner, num_stages, r):  # an FB receives both first
                src, key = need
                queue = sent[(src, r)]
                if key not in queue:
                    raise ValueError(f"rank {r} needs {key[0]} of microbatch {key[1]} from stage "
                                     f"{key[2]} (rank {src}), which is never sent")
                last = queue.index(key)  # already received when last < posted[src]
                while posted[src] <= last:
                    kind, mb, s = queue[posted[src]]
                    out.append(Action("RECV_F", mb, s + 1, src) if kind == "F" else Action("RECV_B", mb, s - 1, src))
                    posted[src] += 1
            out.append(pair)
        result.append(out)
    return result


def _inputs_from_peers(pair: Action, owner: dict[int, int], num_stages: int, r: int):
    """(source rank, message key) of each tensor that ``pair``'s halves receive from another rank."""
    for a in halves(pair):
        if a.kind == "F" and a.stage > 0 and owner[a.stage - 1] != r:
            yield owner[a.stage - 1], ("F", a.microbatch, a.stage - 1)
        elif a.kind in ("B", "BW") and a.stage + 1 < num_stages and owner[a.stage + 1] != r:
            yield owner[a.stage + 1], ("B", a.microbatch, a.stage + 1)


# ---- checks shared by the schedules --------------------------------------------------------
def _one_chunk(name: str, p: int, m: int, v: int) -> None:
    # Sizes are checked once, by ScheduleSpec.accepts (build_schedule and the config rules).
    if v != 1:
        raise ValueError(f"schedule {name!r} runs one model chunk per rank: virtual stages v={v} must be 1 "
                         "(use 'interleaved' or 'zbv' for several chunks)")


# ---- GPipe -------------------------------------------------------------------------------
def check_gpipe(p: int, m: int, v: int) -> None:
    _one_chunk("gpipe", p, m, v)


def gpipe(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every forward, then every backward. Peak in-flight activations
    on every rank: ``m``."""
    check_gpipe(p, m, v)
    return with_p2p([[F(i, r) for i in range(m)] + [BW(i, r) for i in range(m)] for r in range(p)])


# ---- 1F1B --------------------------------------------------------------------------------
def check_1f1b(p: int, m: int, v: int) -> None:
    _one_chunk("1f1b", p, m, v)


def one_f_one_b(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """1F1B, PipeDream-Flush (Narayanan et al. 2021, section 2.2): ``min(p-r-1, m)`` warm-up
    forwards, then alternate one forward and one backward (steady state), then the remaining
    backwards (cool-down). Bubble fraction ``(p-1)/(m+p-1)``; peak in-flight on rank r ``min(p-r, m)``."""
    check_1f1b(p, m, v)
    return one_f_one_b_with_warmup(m, [p - r - 1 for r in range(p)])


def one_f_one_b_with_warmup(m: int, warmups: list[int]) -> list[list[Action]]:
    """1F1B on ``len(warmups)`` ranks where rank r runs ``min(warmups[r], m)`` warm-up forwards
    (plain 1F1B: ``p-r-1``); peak in-flight on rank r is one more than its warm-up."""
    ranks = []
    for r in range(len(warmups)):
        warmup = min(warmups[r], m)
        acts = [F(i, r) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [F(warmup + i, r), BW(i, r)]
        acts += [BW(i, r) for i in range(m - warmup, m)]
        ranks.append(acts)
    return with_p2p(ranks)


# ---- interleaved 1F1B --------------------------------------------------------------------
def check_interleaved(p: int, m: int, v: int) -> None:
    if v < 2:
        raise ValueError(f"schedule 'interleaved' needs virtual stages v >= 2, got v={v} (with one chunk per "
                         "rank use '1f1b')")
    if m % p:
        raise ValueError(f"schedule 'interleaved' needs microbatches m to be a multiple of the pipeline size p: "
                         f"m={m}, p={p} (Narayanan et al. 2021 run chunks in groups of p microbatches)")


def _interleaved_order(p: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    """(microbatch, local chunk) in the order one rank runs them: groups of p microbatches go
    through chunk 0, then chunk 1, ... (backward: the last chunk first)."""
    order = []
    for k in range(m * v):
        group, within = divmod(k, p * v)
        chunk, offset = divmod(within, p)
        order.append((group * p + offset, v - 1 - chunk if backward else chunk))
    return order


def interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): rank r holds stages ``r, r+p, ...``;
    warm-up ``(p-r-1)*2 + (v-1)*p`` chunk forwards, then one chunk forward and one chunk backward
    alternately, then the cool-down. Bubble fraction ``(p-1)/(v*m+p-1)`` with equal chunk costs."""
    check_interleaved(p, m, v)
    table = loop_placement(p, v)
    fwd = _interleaved_order(p, m, v, backward=False)
    bwd = _interleaved_order(p, m, v, backward=True)
    total = m * v
    ranks = []
    for r in range(p):
        stage = table[r]
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [F(mb, stage[c]) for mb, c in fwd[:warmup]]
        for k in range(total - warmup):
            mb, c = fwd[warmup + k]
            acts.append(F(mb, stage[c]))
            mb, c = bwd[k]
            acts.append(BW(mb, stage[c]))
        acts += [BW(mb, stage[c]) for mb, c in bwd[total - warmup:]]
        ranks.append(acts)
    return with_p2p(ranks)


# ---- ZB-H1 -------------------------------------------------------------------------------
def check_zb_h1(p: int, m: int, v: int) -> None:
    _one_chunk("zb-h1", p, m, v)


def zb_h1(p: int, m: int, v: int = 1) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, section 3.1): 1F1B with the backward split into B and W. Rank r runs
    ``min(p-r, m)`` forwards, then per microbatch ``B``, the ``W`` held back by ``r`` places, and
    the next ``F``; the held-back W's fill the cool-down. With B off the critical path the idle
    time per rank is ``(p-1)(F+B-W)`` instead of 1F1B's ``(p-1)(F+B+W)``. Peak in-flight
    activations (F done, W not yet) ``min(p, m)`` on every rank."""
    check_zb_h1(p, m, v)
    ranks = []
    for r in range(p):
        warmup = min(p - r, m)
        acts = [F(i, r) for i in range(warmup)]
        for j in range(m):
            acts.append(B(j, r))
            if j >= r:
                acts.append(W(j - r, r))
            if warmup + j < m:
                acts.append(F(warmup + j, r))
        acts += [W(j, r) for j in range(max(m - r, 0), m)]
        ranks.append(acts)
    return with_p2p(ranks)


# ---- ZBV ---------------------------------------------------------------------------------
def check_zbv(p: int, m: int, v: int) -> None:
    if v != 2:
        raise ValueError(f"schedule 'zbv' places exactly 2 chunks per rank in a V (Qi et al. 2023, section 6): "
                         f"virtual stages v={v} must be 2")


def zbv(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023, section 6): V placement (rank r holds stages r and 2p-1-r) with split
    backward, ordered by :func:`greedy_zero_bubble` with at most ``2p`` chunk activations in flight
    per rank: 1F1B's first-rank memory, a chunk being half a stage, as the paper's ZB-V. With equal
    F, B, W costs the simulated bubble is 5.9% at p=4, m=8 and 10.3% at p=8, m=16 (1F1B: 27% and
    30%); the paper's hand-made ZB-V reaches lower bubbles at large m."""
    check_zbv(p, m, v)
    return with_p2p(greedy_zero_bubble(v_placement(p, 2), m, limit=2 * p))


def greedy_zero_bubble(placement: list[list[int]], m: int, limit: int) -> list[list[Action]]:
    """Order F, B and W on every rank by a list-scheduling pass with unit costs.

    At every time step each free rank takes, in priority order: the ready ``B`` of the highest
    stage (the critical path of the backward); a ready ``F`` of the highest stage, where a new
    microbatch enters the rank's first (lowest) stage only if the activations it will hold there
    (one per stage of the rank, each alive from its F to its W) still fit under ``limit``
    together with those already promised; else the oldest pending ``W``. So the peak in-flight
    activations per rank never exceed ``limit``. Qi et al. 2023 (section 4) build their
    schedules with a similar heuristic.

    Returns:
        Compute-only action lists (pass them to :func:`with_p2p`).
    """
    owner = rank_of_stage(placement)
    num_stages = len(owner)
    done: dict[tuple[str, int, int], int] = {}  # (kind, mb, stage) -> finish time
    orders: list[list[Action]] = [[] for _ in placement]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in placement]
    # Activation slots promised on each rank: a microbatch entering a rank will hold one
    # activation per stage of that rank until its W, so it reserves them all when it enters.
    committed = [0] * len(placement)
    # F's and B's of a stage run in microbatch order, so the next one is a counter (not a scan).
    next_mb = {(kind, s): 0 for kind in ("F", "B") for s in range(num_stages)}
    remaining = 3 * m * num_stages
    t = idle_steps = 0
    while remaining:
        progressed = False
        for r, stages in enumerate(placement):
            def ready(kind: str, mb: int, s: int) -> bool:
                if (kind, mb, s) in done:
                    return False
                if kind == "F":
                    return s == 0 or done.get(("F", mb, s - 1), t + 1) <= t
                return done.get(("F", mb, s), t + 1) <= t and (
                    s == num_stages - 1 or done.get(("B", mb, s + 1), t + 1) <= t)

            choice = None
            for s in sorted(stages, reverse=True):
                mb = next_mb["B", s] if next_mb["B", s] < m else None
                if mb is not None and ready("B", mb, s):
                    choice = ("B", mb, s)
                    break
            if choice is None:
                for s in sorted(stages, reverse=True):
                    mb = next_mb["F", s] if next_mb["F", s] < m else None
                    if mb is None or not ready("F", mb, s):
                        continue
                    if s == stages[0] and committed[r] + len(stages) > limit:
                        continue
                    choice = ("F", mb, s)
                    break
            if choice is None and pending_w[r]:
                mb, s = pending_w[r].pop(0)
                choice = ("W", mb, s)
            if choice is None:
                continue
            kind, mb, s = choice
            done[choice] = t + 1
            if kind != "W":
                next_mb[kind, s] += 1
            progressed = True
            orders[r].append(Action(kind, mb, s))
            remaining -= 1
            if kind == "F" and s == stages[0]:
                committed[r] += len(stages)
            elif kind == "B":
                pending_w[r].append((mb, s))
            elif kind == "W":
                committed[r] -= 1
        t += 1
        idle_steps = 0 if progressed else idle_steps + 1
        if idle_steps > 2:  # every action waits on an action that can never run
            raise ValueError(f"greedy_zero_bubble is stuck at time {t} with limit={limit}; raise the limit")
    return orders
