"""Observability on demand for chosen training steps: ``torch.profiler`` traces
(``train.profile_steps``), memory snapshots (``train.memory_snapshot_steps``) and the measured
pipeline timeline as Chrome trace-event JSON (``train.timeline_steps``).

:meth:`StepObserver.step` wraps one training step. Outside the chosen steps it yields None and
does nothing else: no profiler session exists, no interval recorder is installed, and
:func:`paratron.parallel.profiling.labelled` (the runtime's per-action range) finds the profiler
off and opens no range. In a profiled step the ranges are:

* ``step N`` around the whole step;
* one per pipeline action, opened by the runtime: :func:`~paratron.pipeline.timeline.event_name`
  of its kind, microbatch and virtual stage (``F mb3 stage1``, ``B mb0 stage0``, ``W ...``);
* one per interval paratron records (:class:`ProfiledRecorder`): the MoE all-to-alls
  (``dispatch``/``combine`` and their ``_grad``, from issue to the program's wait) and expert
  compute, and the DP bucket reductions (``bucket_reduce``, issue to wait).

The profiler runs from the start of the first profiled step to the end of the last one and each
rank of ``train.profile_ranks`` writes ``RUN_DIR/profile/rank_N.json`` (Chrome trace, from
``torch.profiler``'s own exporter). Why not ``torch.profiler.schedule``: it counts
``prof.step()`` calls, so steps outside the range would still run inside a profiler session
(the ``wait`` phase); here the session does not exist outside the range.
"""

from __future__ import annotations

import gc
import json
import pickle
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from paratron.parallel.intervals import IntervalRecorder
from paratron.parallel.profiling import labelled
from paratron.pipeline.timeline import RecordedTimeline, event_name, from_intervals, merge_ranks, write_chrome_trace

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocation events kept by ``torch.cuda.memory._record_memory_history`` for the snapshots."""


class ProfiledRecorder(IntervalRecorder):
    """An :class:`IntervalRecorder` that also opens a ``torch.profiler`` range per interval,
    named :func:`event_name` of its kind and scope: a compute interval from open to close, a
    communication one from its issue to the program's wait (ranges may then interleave with the
    action ranges; Chrome's format allows it)."""

    def __init__(self) -> None:
        super().__init__()
        self._ranges: dict[int, torch.profiler.record_function] = {}

    def open(self, kind: str, *, comm: bool = False, chunk: int | None = None):
        iv = super().open(kind, comm=comm, chunk=chunk)
        mb, stage = iv.scope if len(iv.scope) == 2 else (-1, -1)
        rng = torch.profiler.record_function(event_name(kind, mb, stage))
        rng.__enter__()
        self._ranges[id(iv)] = rng  # ``iv`` stays in ``intervals``: its id is not reused
        return iv

    def close(self, iv) -> None:
        IntervalRecorder.close(iv)
        self._end(iv)

    def waited(self, iv) -> None:
        IntervalRecorder.waited(iv)
        self._end(iv)

    def _end(self, iv) -> None:
        rng = self._ranges.pop(id(iv), None)
        if rng is not None:
            rng.__exit__(None, None, None)


class StepObserver:
    """The observability options of one rank (``train.profile_steps``, ``profile_ranks``,
    ``memory_snapshot_steps``, ``timeline_steps``).

    Args:
        cfg: the run's config.
        ctx: the parallel context (``ctx.world`` gathers the timelines to rank 0).
        run_dir: where ``profile/``, ``memory/`` and ``timeline/`` go.
    """

    def __init__(self, cfg, ctx, run_dir: Path) -> None:
        t = cfg.train
        self.ctx, self.run_dir = ctx, Path(run_dir)
        on_this_rank = not t.profile_ranks or ctx.rank in t.profile_ranks
        self.profile = tuple(t.profile_steps) if t.profile_steps and on_this_rank else None
        self.memory_steps, self.timeline_steps = set(t.memory_snapshot_steps), set(t.timeline_steps)
        self.profiler = None
        if self.memory_steps and ctx.device.type == "cuda":  # snapshots with allocation stacks
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    def profiles(self, step: int) -> bool:
        """Whether this rank runs the profiler in ``step`` (1-based)."""
        return self.profile is not None and self.profile[0] <= step <= self.profile[1]

    @contextmanager
    def step(self, step: int, record: bool = False):
        """Wrap training step ``step`` (1-based). Yields the timeline list to hand to
        ``run_pipeline(timeline=)``, or None when this step is neither profiled nor traced and
        ``record`` (the caller needs the timeline itself) is False. After the step: the
        timeline file (a collective over every rank: all reach the same traced steps), the
        profiler's trace after its last step, the memory snapshot."""
        profiled, traced = self.profiles(step), step in self.timeline_steps
        if profiled or traced or record:
            if profiled and self.profiler is None:
                self.start_profiler()
            timeline = RecordedTimeline(time.perf_counter())
            wall = time.time() - (time.perf_counter() - timeline.origin)
            rec = ProfiledRecorder() if profiled else IntervalRecorder()
            ledger = self.ctx.ledger
            prev, ledger.intervals = ledger.intervals, rec
            try:
                with labelled(f"step {step}"):
                    yield timeline
            finally:
                ledger.intervals = prev
            if traced:
                self.write_timeline(step, wall, timeline, rec)
            if profiled and step == self.profile[1]:
                self.stop_profiler()
        else:
            yield None
        if step in self.memory_steps:
            self.write_memory(step)

    # ---- the profiler ----------------------------------------------------------------------
    def start_profiler(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.ctx.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def stop_profiler(self) -> Path | None:
        """Stop a running profiler and write its trace; returns the path (None: none ran)."""
        if self.profiler is None:
            return None
        prof, self.profiler = self.profiler, None
        prof.stop()
        path = self.run_dir / "profile" / f"rank_{self.ctx.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        return path

    def close(self) -> None:
        """End of training: a profiler still running (the run stopped inside the range) writes
        what it has."""
        self.stop_profiler()

    # ---- the timeline ----------------------------------------------------------------------
    def write_timeline(self, step: int, wall: float, timeline: RecordedTimeline, rec: IntervalRecorder) -> None:
        """Gather every rank's actions and recorded intervals to rank 0, which writes
        ``timeline/step_N.json`` (one track per global rank, aligned by the wall clock)."""
        events = step_events(timeline, rec)
        parts = self.ctx.world.all_gather_object((self.ctx.rank, wall, events))
        if self.ctx.rank == 0:
            path = self.run_dir / "timeline" / f"step_{step}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_chrome_trace(merge_ranks(parts), path)

    # ---- memory ----------------------------------------------------------------------------
    def write_memory(self, step: int) -> Path:
        """``memory/rank_N_step_S``: the CUDA allocator's snapshot (``.pickle``) on a GPU, else
        the live-tensor inventory (``.json``)."""
        out = self.run_dir / "memory"
        out.mkdir(parents=True, exist_ok=True)
        stem = f"rank_{self.ctx.rank}_step_{step}"
        if self.ctx.device.type == "cuda":
            path = out / f"{stem}.pickle"
            with open(path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            return path
        path = out / f"{stem}.json"
        path.write_text(json.dumps(dict(tensor_inventory(), rank=self.ctx.rank, step=step), indent=1))
        return path


def step_events(timeline: RecordedTimeline, rec: IntervalRecorder) -> list:
    """One step's trace events: the runtime's actions (lane ``""``) and every interval the step's
    recorder holds (the runtime appended those recorded inside its call; the recorder also holds
    the DP bucket reductions waited after it), on the timeline's clock."""
    actions = [e for e in timeline if e.lane == ""]
    return actions + from_intervals(rec.intervals, 0, timeline.origin)


def tensor_inventory() -> dict:
    """Live tensors of this process, found through the garbage collector's objects, grouped by
    (device, dtype, shape, kind), ``kind`` ``"parameter"`` or ``"tensor"``. Bytes are storage
    bytes, each storage counted once (views such as the params' slices of the flat DDP buffers
    add nothing); ``total_bytes`` and ``by_device`` sum them.

    Returns:
        ``{"total_bytes", "by_device": {device: bytes}, "tensors": [{device, dtype, shape,
        kind, count, bytes}, ...]}``, largest first.
    """
    groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    seen: set[tuple[str, int]] = set()
    for obj in gc.get_objects():
        try:
            if not issubclass(type(obj), torch.Tensor) or obj.is_meta:  # type(): no __class__ lookups
                continue
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
        except (ReferenceError, RuntimeError, NotImplementedError):  # proxies, tensors without storage
            continue
        kind = "parameter" if isinstance(obj, torch.nn.Parameter) else "tensor"
        g = groups[(str(obj.device), str(obj.dtype).removeprefix("torch."), tuple(obj.shape), kind)]
        g[0] += 1
        if key not in seen:
            seen.add(key)
            g[1] += storage.nbytes()
    tensors = [{"device": d, "dtype": dt, "shape": list(s), "kind": k, "count": c, "bytes": b}
               for (d, dt, s, k), (c, b) in groups.items()]
    tensors.sort(key=lambda r: -r["bytes"])
    by_device: dict[str, int] = defaultdict(int)
    for r in tensors:
        by_device[r["device"]] += r["bytes"]
    return {"total_bytes": sum(by_device.values()), "by_device": dict(by_device), "tensors": tensors}
