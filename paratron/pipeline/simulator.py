"""Cost a schedule's action lists: makespan, bubble per rank, peak in-flight activations.

The simulator executes the same lists as the runtime, under the same batched p2p semantics
(:func:`paratron.pipeline.validate.execute`), with a duration per compute action and a p2p
latency. Closed forms it reproduces with unit costs and zero latency (tested):

* 1F1B: bubble fraction ``(p-1)/(m+p-1)`` on every rank; peak in-flight on rank r ``p-r`` for
  ``m >= p`` (Narayanan et al. 2021, section 2.2);
* interleaved 1F1B: ``(p-1)/(v*m+p-1)`` when each chunk costs ``1/v`` of a stage (same source);
* ZB-H1: idle time per rank ``(p-1)(F+B-W)`` against 1F1B's ``(p-1)(F+B+W)``
  (Qi et al. 2023, section 3.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .actions import Action, activation_peak, halves
from .validate import Span, execute


@dataclass(frozen=True)
class Costs:
    """Durations of compute actions (any unit: seconds, or abstract units) and p2p latency.

    ``BW`` defaults to ``B + W`` and ``R`` (a recomputed forward) to ``F``. Per-link costs
    (CrossPipe): ``link_latency[k]`` and ``link_bandwidth[k]`` (message size per time
    unit) for the link between pipeline ranks ``k`` and ``k+1``, with ``message_size`` the size of
    one activation; see :meth:`link_time`. ``stage_scale`` optionally multiplies the cost of every action
    of a stage (e.g. a stage holding the embedding or the loss), indexed by stage.

    ``comm_F`` and ``comm_B`` are the parts of ``F`` and of ``B`` (and of ``BW``; ``W`` has none)
    spent waiting on the MoE all-to-alls. A plain action waits for them; an ``FB`` pair
    (:mod:`.overlap`) hides each half's all-to-alls behind the other half's compute, so it costs
    ``max(F + B - comm_F - comm_B, comm_F + comm_B)``: the compute of both halves runs back to
    back on the rank while both halves' exchanges share the network (the ideal of DeepSeek-V3's
    overlap, section 3.2.1; with no comm it is ``F + B``, the two actions in a row).

    ``EF`` and ``EB`` are the encoder forward and backward of one whole microbatch (multimodal
    models, :mod:`.encoder_schedule`); an ``EF``/``EB`` action runs one of its ``encoder_parts``
    equal parts and costs ``EF / encoder_parts`` (``stage_scale`` does not apply to them).
    """

    F: float = 1.0
    B: float = 1.0
    W: float = 1.0
    BW: float | None = None
    latency: float = 0.0
    stage_scale: tuple[float, ...] | None = None
    R: float | None = None
    link_latency: tuple[float, ...] | None = None
    link_bandwidth: tuple[float, ...] | None = None
    message_size: float = 0.0
    comm_F: float = 0.0
    comm_B: float = 0.0
    EF: float = 0.0
    EB: float = 0.0
    encoder_parts: int = 1

    def link_time(self, src: int, dst: int) -> float:
        """Time of one message from pipeline rank ``src`` to ``dst``: ``latency``, plus, on link
        ``k`` (between ranks ``k`` and ``k+1``; ``k = p-1`` is the wrap-around link between rank
        ``p-1`` and rank 0 that interleaved schedules use), ``link_latency[k]`` and
        ``message_size / link_bandwidth[k]``; a link not listed adds nothing."""
        k = min(src, dst) if abs(src - dst) == 1 else max(src, dst)
        extra = 0.0
        if self.link_latency is not None and k < len(self.link_latency):
            extra += self.link_latency[k]
        if self.link_bandwidth is not None and k < len(self.link_bandwidth) and self.message_size:
            extra += self.message_size / self.link_bandwidth[k]
        return self.latency + extra

    def __call__(self, a: Action) -> float:
        if a.kind == "FB":
            f, b = halves(a)
            scale_f, scale_b = (self.stage_scale[f.stage], self.stage_scale[b.stage]) if self.stage_scale else (1, 1)
            comm = self.comm_F * scale_f + self.comm_B * scale_b
            return max(self(f) + self(b) - comm, comm)
        if a.kind in ("EF", "EB"):
            return (self.EF if a.kind == "EF" else self.EB) / self.encoder_parts
        base = {"F": self.F, "B": self.B, "W": self.W,
                "BW": self.BW if self.BW is not None else self.B + self.W,
                "R": self.R if self.R is not None else self.F}[a.kind]
        if self.stage_scale is not None:
            base *= self.stage_scale[a.stage]
        return base


@dataclass
class SimResult:
    """What :func:`simulate` measures.

    Attributes:
        makespan: end of the last action on any rank (cost unit).
        busy: per rank, the summed duration of its compute actions.
        idle: per rank, ``makespan - busy``.
        bubble: per rank, ``idle / makespan`` (the bubble fraction).
        peak_in_flight: per rank, the most (microbatch, stage) activations held at once: counted
            from the start of ``F`` (of ``R`` when recomputed) until the end of ``BW`` or of ``W``
            (:func:`~paratron.pipeline.actions.activation_peak`).
        spans: the executed timeline, per rank.
    """

    makespan: float
    busy: list[float]
    idle: list[float]
    bubble: list[float]
    peak_in_flight: list[int]
    spans: list[list[Span]] = field(repr=False)

    def summary(self) -> str:
        rows = [f"makespan {self.makespan:.6g}"]
        for r, (b, k) in enumerate(zip(self.bubble, self.peak_in_flight)):
            rows.append(f"rank {r}: bubble {b:.4f}  idle {self.idle[r]:.6g}  peak in-flight {k}")
        return "\n".join(rows)


def simulate(schedule: list[list[Action]], costs: Costs | Callable[[Action], float] = Costs(),
             latency: float | None = None) -> SimResult:
    """Execute ``schedule`` with ``costs`` and measure it.

    Args:
        schedule: one action list per pipeline rank (as built by a registered schedule).
        costs: a :class:`Costs`, or any ``action -> duration`` function.
        latency: p2p latency, or ``(src, dst) -> time``; defaults to ``costs.link_time`` for a
            :class:`Costs` (its ``latency`` plus the per-link costs), 0 for a plain function.

    Raises:
        ScheduleError: the lists deadlock or their messages do not match (see :func:`execute`).
    """
    if latency is None:
        latency = costs.link_time if isinstance(costs, Costs) else getattr(costs, "latency", 0.0)
    spans = execute(schedule, costs, latency)
    makespan = max((s.end for rank in spans for s in rank), default=0.0)
    busy = [sum(s.end - s.start for s in rank if not s.action.is_p2p) for rank in spans]
    idle = [makespan - b for b in busy]
    bubble = [i / makespan if makespan > 0 else 0.0 for i in idle]
    return SimResult(makespan, busy, idle, bubble, [peak_in_flight(rank) for rank in spans], spans)


def peak_in_flight(rank_spans: list[Span]) -> int:
    """Most activations alive at once on one rank (:func:`activation_peak` of its actions)."""
    return activation_peak([s.action for s in rank_spans])
