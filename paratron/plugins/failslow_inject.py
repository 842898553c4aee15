"""Fail-slow injection for tests and benchmarks: make one rank's compute slower by sleeping.

``PARATRON_SLOW_RANK=RANK:FACTOR`` (e.g. ``1:2``) slows global rank RANK about FACTOR times:
each forward of each model chunk on that rank is followed by a sleep of ``(FACTOR - 1) x 3 x`` the
median duration of its recent forwards (the backward is taken to cost twice the forward), inside the chunk's forward, so that
the slowdown is per microbatch and the fail-slow detector (:mod:`paratron.plugins.failslow`)
counts it as compute. Unset, or another rank: nothing changes.

``RANK:FACTOR:UNTIL`` ends the slowdown after iteration UNTIL (the steps from UNTIL + 1 on run
at full speed). Chunks rebuilt by an online re-layout (a new ``state.chunks``) are slowed too.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque

from paratron.training.callbacks import Callback, TrainState


def parse_slow_rank(value: str) -> tuple[int, float, int | None]:
    """``"RANK:FACTOR"`` or ``"RANK:FACTOR:UNTIL"`` -> ``(rank, factor, until or None)``.

    Raises:
        ValueError: not two or three fields, or a factor < 1.
    """
    try:
        fields = value.split(":")
        if len(fields) not in (2, 3):
            raise ValueError
        out = int(fields[0]), float(fields[1]), int(fields[2]) if len(fields) == 3 else None
    except ValueError:
        raise ValueError(f"PARATRON_SLOW_RANK={value!r} must look like RANK:FACTOR or RANK:FACTOR:UNTIL, "
                         "e.g. 1:2 or 1:2:12") from None
    if out[1] < 1:
        raise ValueError(f"PARATRON_SLOW_RANK={value!r}: the factor must be >= 1")
    return out


class SlowRank(Callback):
    def __init__(self, state: TrainState) -> None:
        value = os.environ.get("PARATRON_SLOW_RANK")
        self.factor, self.until, self.slowed, self.on = 1.0, None, None, True
        if not value:
            return
        rank, factor, self.until = parse_slow_rank(value)
        if state.ctx.rank == rank and factor != 1:
            self.factor = factor
            self.wrap(state.chunks)

    def wrap(self, chunks) -> None:
        self.slowed = chunks
        for chunk in chunks:
            chunk.forward = _slowed(chunk.forward, self.factor, self.active)

    def active(self) -> bool:
        return self.on

    def on_step_start(self, state: TrainState) -> None:
        self.on = self.until is None or state.iteration < self.until
        if self.slowed is not None and state.chunks is not self.slowed:  # re-laid out: slow the new chunks
            self.wrap(state.chunks)


def _slowed(forward, factor: float, active):
    # An instance attribute: Module.__call__ runs it between the module's hooks. The sleep follows
    # the median of the recent forward times, so that one preempted forward (a loaded machine)
    # does not change the injected slowdown.
    recent: deque = deque(maxlen=9)

    def slowed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        recent.append(time.perf_counter() - t0)
        if active():
            time.sleep((factor - 1) * 3 * statistics.median(recent))
        return out

    return slowed
