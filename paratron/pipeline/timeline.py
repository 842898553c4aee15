"""Draw a pipeline timeline: PNG (matplotlib, Agg) and Chrome trace JSON (chrome://tracing, Perfetto).

Both the simulator's plan (:class:`~paratron.pipeline.validate.Span` lists) and the runtime's
recorded run (:class:`TraceEvent` lists) convert to :class:`TraceEvent`, so a plan and a run are
written in the same format and open side by side in Perfetto.

Besides one event per action (lane ``""``), a recorded run holds the intervals recorded inside the
actions (:mod:`paratron.parallel.intervals`, e.g. the MoE dispatcher's all-to-alls and expert
compute): lane ``"compute"`` and lane ``"comm"``, drawn as extra rows under each rank (in the
Chrome trace: processes 1 and 2, one thread per rank), so overlapping communication shows as
boxes stacked over compute.

Names: every event (and every ``record_function`` range the runtime opens under
``torch.profiler``) is called :func:`event_name` of its kind, microbatch and virtual stage, e.g.
``"F mb3 stage1"``; its ``cat`` is the kind, the legend entry of the drawn picture, and each
rank's track is ``"rank r"``, the picture's row label. A training run's step timeline
(``train.timeline_steps``) and ``paratron simulate --trace`` are written by
:func:`write_chrome_trace`, so the measured and the planned step open side by side in Perfetto.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from paratron.parallel.intervals import Interval

from .validate import Span

COLOURS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "BW": "#C44E52", "R": "#8172B3", "FB": "#64B5CD",
           "SEND_F": "#8C8C8C", "RECV_F": "#8C8C8C", "SEND_B": "#B0B0B0", "RECV_B": "#B0B0B0",
           "experts": "#4C72B0", "experts_grad": "#DD8452", "dispatch": "#937860", "combine": "#DA8BC3",
           "dispatch_grad": "#8C613C", "combine_grad": "#B45A9E", "EF": "#CCB974", "EB": "#937860"}
LANES = ("", "compute", "comm")
"""Event lanes: pipeline actions, compute recorded inside them, communication recorded inside them."""


@dataclass(frozen=True)
class TraceEvent:
    """One action on one pipeline rank; ``start``/``end`` in seconds (or the simulator's unit).
    ``lane``: ``""`` for an action, ``"compute"``/``"comm"`` for an interval recorded inside one
    (``microbatch``/``stage``: the action's, -1 outside any)."""

    rank: int
    kind: str
    microbatch: int
    stage: int
    start: float
    end: float
    lane: str = ""


def event_name(kind: str, microbatch: int = -1, stage: int = -1) -> str:
    """The one name of an action or recorded interval in traces and profiler ranges:
    ``"F mb3 stage1"`` (kind, microbatch, virtual stage in model order, which fixes the rank's
    model chunk); just the kind outside any action (``"bucket_reduce"`` after the schedule)."""
    if microbatch < 0:
        return kind
    return f"{kind} mb{microbatch}" + (f" stage{stage}" if stage >= 0 else "")


class RecordedTimeline(list):
    """A list for ``run_pipeline(timeline=)`` whose events count from ``origin`` (a
    ``time.perf_counter()`` value the caller chose, e.g. the start of a training step) instead of
    the start of the pipeline call, so that intervals recorded outside the call (the DP bucket
    reductions waited after it) share its clock."""

    def __init__(self, origin: float) -> None:
        super().__init__()
        self.origin = origin


def from_intervals(intervals: list[Interval], rank: int, t0: float) -> list[TraceEvent]:
    """Recorded intervals -> trace events on ``rank``, in seconds since ``t0`` (a
    ``time.perf_counter()`` value). A comm event spans issue to completion (``Interval.end``);
    intervals never closed are left out."""
    out = []
    for iv in intervals:
        if iv.end is None:
            continue
        mb, stage = iv.scope if len(iv.scope) == 2 else (-1, -1)
        out.append(TraceEvent(rank, iv.kind, mb, stage, iv.start - t0, iv.end - t0,
                              "comm" if iv.comm else "compute"))
    return out


def merge_ranks(parts: list[tuple[int, float, list[TraceEvent]]]) -> list[TraceEvent]:
    """Several ranks' timelines -> one, on a shared clock: each part is ``(track, wall-clock
    seconds (``time.time()``) of its time zero, its events)``; the result counts from the
    earliest zero, and each event's ``rank`` becomes its part's track (a global rank: pipeline
    ranks repeat over TP and DP). Wall clocks agree within one host; across hosts they are as
    close as the hosts' clock sync."""
    base = min((wall for _, wall, _ in parts), default=0.0)
    out = []
    for track, wall, events in parts:
        shift = wall - base  # small: adding the ~1e9 s wall clock to each time would cost its microseconds
        out += [replace(e, rank=track, start=e.start + shift, end=e.end + shift) for e in events]
    return out


def from_spans(spans: list[list[Span]], compute_only: bool = True) -> list[TraceEvent]:
    """Simulator spans -> trace events (p2p batches dropped unless ``compute_only`` is False)."""
    return [TraceEvent(s.rank, s.action.kind, s.action.microbatch, s.action.stage, s.start, s.end)
            for rank in spans for s in rank if not (compute_only and s.action.is_p2p)]


def chrome_trace(events: list[TraceEvent], time_unit_us: float = 1e6) -> dict:
    """Chrome trace dict: one process per lane (0: pipeline actions, 1: compute, 2: comm), one
    thread per pipeline rank, one complete ("X") event per action or interval.

    Args:
        time_unit_us: microseconds per unit of ``start``/``end`` (1e6 for seconds).
    """
    out = []
    for pid, lane in enumerate(LANES):
        if pid and not any(e.lane == lane for e in events):
            continue
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": lane or "pipeline"}})
        for r in sorted({e.rank for e in events if e.lane == lane}):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}})
    for e in events:
        out.append({"name": event_name(e.kind, e.microbatch, e.stage), "cat": e.kind, "ph": "X", "pid": LANES.index(e.lane),
                    "tid": e.rank, "ts": e.start * time_unit_us, "dur": max(e.end - e.start, 0.0) * time_unit_us,
                    "args": {"microbatch": e.microbatch, "stage": e.stage}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: list[TraceEvent], path: str | Path, time_unit_us: float = 1e6) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events, time_unit_us)))
    return path


def read_chrome_trace(path: str | Path, time_unit_us: float = 1e6) -> list[TraceEvent]:
    """Read back a trace written by :func:`write_chrome_trace`."""
    data = json.loads(Path(path).read_text())
    return [TraceEvent(e["tid"], e["cat"], e["args"]["microbatch"], e["args"]["stage"],
                       e["ts"] / time_unit_us, (e["ts"] + e["dur"]) / time_unit_us, LANES[e.get("pid", 0)])
            for e in data["traceEvents"] if e.get("ph") == "X"]


def draw_png(events: list[TraceEvent], path: str | Path, title: str = "", unit: str = "") -> Path:
    """Draw one row per rank (plus one per recorded lane under it), one box per action or interval
    coloured by kind and labelled with its microbatch; boxes of later model chunks (stage >=
    number of ranks) are lighter.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e.rank for e in events})
    rows = sorted({(e.rank, LANES.index(e.lane)) for e in events})  # recorded intervals under their rank
    end = max((e.end for e in events), default=1.0) or 1.0
    per_rank = len(events) / max(len(ranks), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, min(20.0, per_rank * 0.25)), 0.6 * len(rows) + 1.4))
    for e in events:
        y = rows.index((e.rank, LANES.index(e.lane)))
        # Later model chunks (virtual stages beyond the first p) are drawn lighter.
        alpha = (1.0, 0.65, 0.4)[min(max(e.stage, 0) // len(ranks), 2)]
        ax.barh(y, e.end - e.start, left=e.start, height=0.8, color=COLOURS.get(e.kind, "#999999"),
                alpha=alpha, edgecolor="black", linewidth=0.3)
        if (e.end - e.start) / end > 0.008 and e.microbatch >= 0:
            ax.text((e.start + e.end) / 2, y, str(e.microbatch), ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(range(len(rows)), [f"rank {r} {LANES[lane]}".rstrip() for r, lane in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({unit})" if unit else "time")
    kinds = [k for k in COLOURS if any(e.kind == k for e in events)]
    # Above the axes, right-aligned, so that it never hides the first rank's row.
    ax.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="lower right", fontsize=7,
              ncol=len(kinds), bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title, loc="left", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
