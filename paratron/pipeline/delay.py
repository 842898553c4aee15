"""Delay-aware 1F1B for a slow pipeline link (CrossPipe; USENIX ATC 2025), and a p2p delay
injector for tests and benchmarks.

When one link between pipeline ranks (say, between two data centres) has a latency ``d``, 1F1B's
ranks upstream of it stall: each of their backwards waits for a grad that crossed the link twice
(the activation going down, the grad coming back), ``2d`` later than 1F1B's warm-up assumes.
CrossPipe keeps those ranks busy by letting more microbatches be in flight there: each rank at
or before the slow link runs ``ceil(2 d / t)`` more warm-up forwards, with ``t`` the time of one
microbatch's forward and backward on a stage, so the round trip overlaps compute. The cost is
that many more activations held on those ranks.

:class:`LinkDelay` adds a fixed latency to one link of a real run by delaying the receiver's wait:
each message over the link carries its send time, and the wait returns no earlier than that time
plus the delay. It wraps the pipeline group (:class:`DelayedGroup`, through :meth:`LinkDelay.over`),
so the runtime's p2p path knows nothing of it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .actions import Action
from .schedules import check_1f1b, one_f_one_b_with_warmup


def link_latency_seconds(parallel_cfg) -> tuple[float, ...] | None:
    """``parallel.pipeline_link_latency_ms`` in seconds, for ``Costs(link_latency=...)`` and
    ``build_schedule("1f1b-delay", ..., link_latency=...)``; None when unset."""
    lat = parallel_cfg.pipeline_link_latency_ms
    return None if lat is None else tuple(x / 1e3 for x in lat)


def config_options(parallel_cfg, measured_microbatch_time: float | None = None) -> dict | None:
    """``1f1b-delay``'s keywords from the config, for the training step's ``build_schedule``.

    ``link_latency`` comes from ``parallel.pipeline_link_latency_ms``; ``microbatch_time`` (s)
    from ``parallel.pipeline_microbatch_time_ms``, else from ``measured_microbatch_time``
    (:func:`measured_microbatch_time` of a run).

    Returns:
        The keywords (``{}`` without link latencies: plain 1F1B), or None when the latencies are
        set but no microbatch time is known yet: the caller builds plain 1F1B meanwhile, measures
        a step, and asks again.
    """
    lat = link_latency_seconds(parallel_cfg)
    if lat is None or not any(lat):
        return {}
    ms = parallel_cfg.pipeline_microbatch_time_ms
    t = ms / 1e3 if ms is not None else measured_microbatch_time
    return None if t is None else {"link_latency": lat, "microbatch_time": t}


def measured_microbatch_time(timeline: Sequence[Any], num_microbatches: int) -> float:
    """Seconds of compute per microbatch per stage on one rank, from a recorded step
    (``run_pipeline(timeline=)``): the summed duration of its compute actions (F, B, W, BW, R)
    over ``num_microbatches`` times its stages. Take the max over ranks so every rank builds the
    same lists. Raises ValueError for a timeline without compute."""
    # Only the actions: the intervals recorded inside them (lanes "compute"/"comm", e.g. MoE
    # experts and all-to-alls) would count their time twice.
    compute = [e for e in timeline if getattr(e, "lane", "") == "" and not e.kind.startswith(("SEND", "RECV"))]
    if not compute or num_microbatches < 1:
        raise ValueError(f"no compute actions in the timeline ({len(timeline)} events) or "
                         f"num_microbatches={num_microbatches} < 1")
    stages = len({e.stage for e in compute})
    return sum(e.end - e.start for e in compute) / (num_microbatches * stages)


def delay_warmups(p: int, link_latency: Sequence[float] | None, microbatch_time: float) -> list[int]:
    """Warm-up forwards per rank for 1F1B over links with the given extra latencies.

    Args:
        p: pipeline ranks.
        link_latency: ``link_latency[k]``: extra latency of the link between ranks ``k`` and
            ``k+1`` (``p-1`` entries; None: none), in the unit of ``microbatch_time``.
        microbatch_time: forward plus backward of one microbatch on one stage (> 0).

    Returns:
        ``p-r-1 + sum over links k >= r of ceil(2 link_latency[k] / microbatch_time)`` per rank.

    Raises:
        ValueError: a negative latency, a list of another length than ``p-1``, or
            ``microbatch_time <= 0``.
    """
    lat = list(link_latency or [0.0] * (p - 1))
    if len(lat) != p - 1 or any(x < 0 for x in lat):
        raise ValueError(f"link_latency={lat} must list p-1={p - 1} latencies >= 0 (link k joins ranks k and k+1)")
    if microbatch_time <= 0:
        raise ValueError(f"microbatch_time={microbatch_time} must be > 0")
    extra = [math.ceil(2 * x / microbatch_time - 1e-9) for x in lat]
    return [p - r - 1 + sum(extra[r:]) for r in range(p)]


def one_f_one_b_delay(p: int, m: int, v: int = 1, link_latency: Sequence[float] | None = None,
                      microbatch_time: float = 1.0) -> list[list[Action]]:
    """``1f1b-delay``: 1F1B whose warm-up counts come from the link costs (:func:`delay_warmups`);
    without ``link_latency`` it is plain 1F1B. Peak in-flight on rank r: its warm-up + 1
    (at most m). Pass the options through ``build_schedule("1f1b-delay", p, m,
    link_latency=..., microbatch_time=...)``."""
    check_1f1b(p, m, v)
    return one_f_one_b_with_warmup(m, delay_warmups(p, link_latency, microbatch_time))


@dataclass(frozen=True)
class LinkDelay:
    """Fixed extra latency on the pipeline link between ranks ``link[0]`` and ``link[1]``, both
    directions, in ``seconds``; give the same object to every rank's ``run_pipeline``.

    Each message over the link is followed by a stamp (float64 ``[1]``: the sender's
    ``time.monotonic()`` when it posted the send), and the receiver's wait returns no earlier than
    stamp + ``seconds``: the message arrives ``seconds`` after it was sent, however late the
    receive was posted, as on a real slow link (and as the simulator assumes). The clock is the
    host's monotonic clock, so all ranks must run on one machine (tests and benchmarks only).
    Gloo only: :class:`DelayedGroup` pairs each message's work with its stamp's, which needs one
    work per op.
    """

    link: tuple[int, int]
    seconds: float

    def over(self, ctx):
        """A copy of the :class:`~paratron.parallel.context.ParallelContext` ``ctx`` whose
        pipeline group (``ctx.pp``) delays this link; hand it to ``run_pipeline``."""
        return dataclasses.replace(ctx, pp=DelayedGroup(ctx.pp, self))

    def applies(self, rank: int, peer: int) -> bool:
        return {rank, peer} == set(self.link)

    @staticmethod
    def stamp(device=None) -> "torch.Tensor":
        """The send time to post right after a message over the link."""
        return torch.tensor([time.monotonic()], dtype=torch.float64, device=device)

    @staticmethod
    def stamp_buffer(device=None) -> "torch.Tensor":
        """Where to receive a stamp, posted right after the message's receive."""
        return torch.empty(1, dtype=torch.float64, device=device)

    def delayed(self, work: Any, stamp_work: Any, stamp: "torch.Tensor") -> "Delayed":
        """The receive ``work`` whose ``wait`` honours the delay, with its stamp's receive."""
        return Delayed(work, stamp_work, stamp, self.seconds)


class Delayed:
    """A receive whose ``wait()`` returns once the message is in and ``seconds`` after the
    sender's stamp (no polling, no thread: only the wait is delayed)."""

    def __init__(self, work: Any, stamp_work: Any, stamp: "torch.Tensor", seconds: float):
        self.work, self.stamp_work, self.stamp, self.seconds = work, stamp_work, stamp, seconds

    def wait(self) -> None:
        self.work.wait()
        self.stamp_work.wait()
        left = float(self.stamp.item()) + self.seconds - time.monotonic()
        if left > 0:
            time.sleep(left)


class DelayedGroup:
    """A pipeline :class:`~paratron.parallel.comm.Group` whose messages over ``delay.link`` arrive
    ``delay.seconds`` after they were sent; everything else is the wrapped group's.

    :meth:`p2p_op` builds, after each op over the link, the op of its stamp (a send of the send
    time, or a receive of it), and :meth:`batch_isend_irecv` posts each op followed by its stamp's
    and returns one work per op given: a receive's work waits for the delay (:class:`Delayed`),
    a send's for both sends. Both count in the ledger, as real traffic would.
    """

    def __init__(self, group, delay: LinkDelay):
        self.group, self.delay = group, delay

    def __getattr__(self, name: str):
        return getattr(self.group, name)

    def p2p_op(self, kind: str, t: "torch.Tensor", peer_group_rank: int):
        op = self.group.p2p_op(kind, t, peer_group_rank)
        if self.delay.applies(self.group.rank, peer_group_rank):
            stamp = LinkDelay.stamp(t.device) if kind == "send" else LinkDelay.stamp_buffer(t.device)
            op.delay_stamp = (kind, self.group.p2p_op(kind, stamp, peer_group_rank), stamp)
        return op

    def batch_isend_irecv(self, ops: list) -> list:
        stamps = [getattr(op, "delay_stamp", None) for op in ops]
        posted = [x for op, st in zip(ops, stamps) for x in ((op,) if st is None else (op, st[1]))]
        works = iter(self.group.batch_isend_irecv(posted))
        out = []
        for st in stamps:
            work = next(works)
            if st is not None:
                kind, stamp_work, stamp = st[0], next(works), st[2]
                work = _Both(work, stamp_work, stamp) if kind == "send" else self.delay.delayed(work, stamp_work, stamp)
            out.append(work)
        return out


class _Both:
    """A message's send and its stamp's, waited together (the stamp is kept until then)."""

    def __init__(self, work: Any, stamp_work: Any, stamp: "torch.Tensor"):
        self.work, self.stamp_work, self.stamp = work, stamp_work, stamp

    def wait(self) -> None:
        self.work.wait()
        self.stamp_work.wait()
