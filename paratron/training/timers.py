"""Per-phase step timings that do not make the host wait for the device.

Each phase is timed twice: on the host (``time.perf_counter``: what the training loop spent,
known at once, given to the callbacks each step) and, on a GPU, by two CUDA events recorded on
the current stream (what the device spent). The events are read only when asked
(:meth:`PhaseTimer.read`, once per log interval), when they have long completed, so timing adds
no host-device synchronisation to the step. On the CPU the work is synchronous and the host
times are the device times.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per named phase, per step.

    Args:
        device: the training device; CUDA events when its type is ``cuda``.
    """

    def __init__(self, device: torch.device) -> None:
        self.uses_events = torch.device(device).type == "cuda"
        self._host: dict[str, float] = {}
        self._events: dict[str, list] = {}
        self._steps: list[dict] = []
        self.last_host: dict[str, float] = {}
        """Host seconds per phase of the last closed step."""

    @contextmanager
    def phase(self, name: str):
        """Time the ``with`` block as ``name`` in the current step (repeats add up)."""
        pair = None
        if self.uses_events:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            pair[0].record()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host[name] = self._host.get(name, 0.0) + time.perf_counter() - t0
            if pair is not None:
                pair[1].record()
                self._events.setdefault(name, []).append(pair)

    def end_step(self) -> None:
        """Close the current step's phases (the next :meth:`phase` starts a new step)."""
        self.last_host = self._host
        self._steps.append(self._events if self.uses_events else dict(self._host))
        self._host, self._events = {}, {}

    def read(self) -> list[dict[str, float]]:
        """Device seconds per phase of every step closed since the last read, oldest first
        (waits for the last event on a GPU; the host times on the CPU), then forgets them."""
        out = []
        for step in self._steps:
            if self.uses_events:
                for pairs in step.values():
                    pairs[-1][1].synchronize()
                out.append({n: sum(s.elapsed_time(e) for s, e in pairs) / 1e3 for n, pairs in step.items()})
            else:
                out.append(step)
        self._steps = []
        return out
