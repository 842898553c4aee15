"""Training-loop plugin for bench_planner.py: per-step wall times and one step's peak memory.

Step times come from on_step_start/on_step_end. The memory of step ``PROBE_STEP`` is measured as
the bytes of every live tensor at its start (found through ``gc``, storages counted once) plus the
highest sum of the blocks the step allocates and has not yet freed, from the PyTorch profiler's
allocator events (:func:`step_peak`).
Each rank writes ``$PLANNER_PROBE_OUT.rank<N>.json``.
"""

from __future__ import annotations

import gc
import json
import os
import time

import torch

from paratron.training.callbacks import Callback

PROBE_STEP = 3


def live_tensor_bytes() -> int:
    seen, total = set(), 0
    for o in gc.get_objects():
        try:
            if not torch.is_tensor(o):
                continue
            st = o.untyped_storage()
        except Exception:  # noqa: BLE001 - some tensor subclasses have no storage
            continue
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def step_peak(events: list[dict]) -> int:
    """Highest sum of the blocks allocated during the profiled step and still alive. Blocks from
    before the step are in the live-tensor baseline; the profiler cannot size their frees (it warns
    so), and frees made on other threads can go unrecorded (a new block at a live address shows
them), which is why its own running ``Total Allocated`` is not used."""
    live, cur, peak = {}, 0, 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        addr, nbytes = e["args"]["Addr"], e["args"]["Bytes"]
        if nbytes > 0:
            cur -= live.get(addr, 0)  # a block re-allocated at a live address was freed unseen
            live[addr] = nbytes
            cur += nbytes
            peak = max(peak, cur)
        elif addr in live:
            cur -= live.pop(addr)
    return peak


class PlannerProbe(Callback):
    def __init__(self, state):
        self.state, self.times, self.step, self.prof, self.t0 = state, [], 0, None, 0.0
        self.memory = None

    def on_step_start(self, state):
        self.step += 1
        if self.step == PROBE_STEP:
            self.base = live_tensor_bytes()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self.prof.__enter__()
        self.t0 = time.perf_counter()

    def on_step_end(self, state, metrics, timings):
        dt = time.perf_counter() - self.t0
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            path = os.environ["PLANNER_PROBE_OUT"] + f".trace{state.ctx.rank}.json"
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
            if not os.environ.get("PLANNER_PROBE_KEEP"):
                os.remove(path)
            self.memory = self.base + step_peak(events)
            self.prof = None
        else:
            self.times.append(dt)

    def on_train_end(self, state):
        out = {"rank": state.ctx.rank, "step_times": self.times, "peak_bytes": self.memory}
        with open(os.environ["PLANNER_PROBE_OUT"] + f".rank{state.ctx.rank}.json", "w") as f:
            json.dump(out, f)
