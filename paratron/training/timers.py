"""Per-phase step timings that do not make the host wait for the device.

On a GPU each phase is bracketed by two CUDA events recorded on the current stream; the elapsed
times are read only when asked (:meth:`PhaseTimer.read`, once per log interval), when the events
have long completed, so timing adds no host-device synchronisation to the step. On the CPU the
work is synchronous anyway and ``time.perf_counter`` measures it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Seconds per named phase, per step, kept until :meth:`read`.

    Args:
        device: the training device; CUDA events when its type is ``cuda``.
    """

    def __init__(self, device: torch.device) -> None:
        self.uses_events = torch.device(device).type == "cuda"
        self._current: dict[str, list] = {}
        self._steps: list[dict[str, list]] = []

    @contextmanager
    def phase(self, name: str):
        """Time the ``with`` block as ``name`` in the current step (repeats add up)."""
        if self.uses_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._current.setdefault(name, []).append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._current.setdefault(name, []).append(time.perf_counter() - t0)

    def end_step(self) -> None:
        """Close the current step's phases (the next :meth:`phase` starts a new step)."""
        self._steps.append(self._current)
        self._current = {}

    def read(self) -> list[dict[str, float]]:
        """Seconds per phase of every step closed since the last read, oldest first (waits for
        the last event on a GPU), then forgets them."""
        out = []
        for step in self._steps:
            if self.uses_events:
                out.append({n: sum(s.elapsed_time(e) for s, e in ev) / 1e3
                            for n, ev in step.items() if not ev[-1][1].synchronize()})
            else:
                out.append({n: float(sum(v)) for n, v in step.items()})
        self._steps = []
        return out
