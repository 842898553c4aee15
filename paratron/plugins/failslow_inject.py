"""Fail-slow injection for tests and benchmarks: make one rank's compute slower by sleeping.

``PARATRON_SLOW_RANK=RANK:FACTOR`` (e.g. ``1:2``) slows global rank RANK about FACTOR times:
each forward of each model chunk on that rank is followed by a sleep of ``(FACTOR - 1) x 3 x`` the
median duration of its recent forwards (the backward is taken to cost twice the forward), inside the chunk's forward, so that
the slowdown is per microbatch and the fail-slow detector (:mod:`paratron.plugins.failslow`)
counts it as compute. Unset, or another rank: nothing changes.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque

from paratron.training.callbacks import Callback, TrainState


def parse_slow_rank(value: str) -> tuple[int, float]:
    """``"RANK:FACTOR"`` -> ``(rank, factor)``.

    Raises:
        ValueError: not two fields, or a factor < 1.
    """
    try:
        rank, factor = value.split(":")
        out = int(rank), float(factor)
    except ValueError:
        raise ValueError(f"PARATRON_SLOW_RANK={value!r} must look like RANK:FACTOR, e.g. 1:2") from None
    if out[1] < 1:
        raise ValueError(f"PARATRON_SLOW_RANK={value!r}: the factor must be >= 1")
    return out


class SlowRank(Callback):
    def __init__(self, state: TrainState) -> None:
        value = os.environ.get("PARATRON_SLOW_RANK")
        if not value:
            return
        rank, factor = parse_slow_rank(value)
        if state.ctx.rank != rank or factor == 1:
            return
        for chunk in state.chunks:
            chunk.forward = _slowed(chunk.forward, factor)


def _slowed(forward, factor: float):
    # An instance attribute: Module.__call__ runs it between the module's hooks. The sleep follows
    # the median of the recent forward times, so that one preempted forward (a loaded machine)
    # does not change the injected slowdown.
    recent: deque = deque(maxlen=9)

    def slowed(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        recent.append(time.perf_counter() - t0)
        time.sleep((factor - 1) * 3 * statistics.median(recent))
        return out

    return slowed
