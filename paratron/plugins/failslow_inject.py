"""Fail-slow injection for tests and benchmarks: make one rank's compute a fixed factor slower
by sleeping, as a callback (``train.callbacks`` entry ``"paratron.plugins.failslow_inject:SlowRank"``,
with the environment variable below set for the ranks).

``PARATRON_SLOW_RANK=RANK:FACTOR`` (e.g. ``1:2``) slows global rank RANK FACTOR times;
``RANK:FACTOR:UNTIL`` ends the slowdown after iteration UNTIL (the steps from UNTIL + 1 on run at
full speed). Unset, or another rank: nothing changes.

The slowdown is deterministic: steps 1 and 2 run at full speed and step 2 calibrates it, the
medians of that step's forward times of a transformer layer and of each chunk's non-layer work (embedding, final
norm, output layer, loss). From step 3 on, each layer's forward is followed by a sleep of
``(FACTOR - 1) x`` its calibrated forward and its backward by one of ``(FACTOR - 1) x 2 x`` it
(a backward taken as twice the forward); each chunk's non-layer work likewise. The sleeps are
fixed seconds, so the load of other processes on the host does not change them; they sit inside
the layer's or the chunk's forward and backward, so the fail-slow detector
(:mod:`paratron.plugins.failslow`) counts them as that rank's compute, and they move with the
layers: chunks rebuilt by an online re-layout (a new ``state.chunks``) are slowed per layer with
the same calibration.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from paratron.plugins.failslow import chunk_layers
from paratron.training.callbacks import Callback, TrainState

WARMUP_STEPS = 1
"""Steps at full speed left out of the calibration (the first forwards allocate and warm up)."""
CALIBRATION_STEPS = 1
"""Steps at full speed after those whose forward times set the sleeps."""


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
    """The injector (module docstring)."""

    def __init__(self, state: TrainState) -> None:
        value = os.environ.get("PARATRON_SLOW_RANK")
        self.factor, self.until, self.slowed, self.on = 1.0, None, None, False
        self.layer_s: list[float] = []  # calibration: forward seconds of each layer call
        self.head_s: dict[int, list[float]] = {}  # calibration: non-layer forward seconds, per chunk
        self.layer_sleep: float | None = None  # forward seconds of one layer, calibrated
        self.head_sleep: dict[int, float] = {}  # non-layer forward seconds per chunk, calibrated
        if not value:
            return
        rank, factor, self.until = parse_slow_rank(value)
        if state.ctx.rank == rank and factor != 1:
            self.factor = factor
            self.wrap(state.chunks)

    def wrap(self, chunks) -> None:
        self.slowed = chunks
        for i, chunk in enumerate(chunks):
            inner = [0.0]  # seconds spent in the chunk's layers (sleeps included) in its open forward
            for layer in chunk_layers(chunk):
                layer.forward = self._slowed_layer(layer.forward, inner)
            chunk.forward = self._slowed_chunk(i, chunk.forward, inner)

    def on_step_start(self, state: TrainState) -> None:
        if self.slowed is None:
            return
        if state.iteration == WARMUP_STEPS:
            self.layer_s, self.head_s = [], {}
        if self.layer_sleep is None and state.iteration >= WARMUP_STEPS + CALIBRATION_STEPS:
            self.calibrate()
        self.on = self.layer_sleep is not None and (self.until is None or state.iteration < self.until)
        if state.chunks is not self.slowed:  # re-laid out: slow the new chunks
            self.wrap(state.chunks)

    def calibrate(self) -> None:
        self.layer_sleep = statistics.median(self.layer_s) if self.layer_s else 0.0
        self.head_sleep = {i: statistics.median(v) for i, v in self.head_s.items()}

    def _sleep(self, seconds: float) -> None:
        if self.on and seconds > 0:
            time.sleep((self.factor - 1) * seconds)

    def _with_backward_sleep(self, out, seconds: float):
        """``out`` through an identity whose backward sleeps ``(factor - 1) x seconds``: a graph
        node of its own, so it runs after every hook on ``out`` (the detector's clock starts the
        backward there) and before the backward of what made ``out``."""
        if not (self.on and seconds > 0):
            return out
        if isinstance(out, tuple):  # (losses, MTP losses): the first carries the backward
            return (self._with_backward_sleep(out[0], seconds), *out[1:])
        if isinstance(out, torch.Tensor) and out.requires_grad:
            return _SleepInBackward.apply(out, (self.factor - 1) * seconds)
        return out

    def _slowed_layer(self, forward, inner: list[float]):
        # An instance attribute: Module.__call__ runs it between the module's hooks, so the sleeps
        # count as the layer's forward and backward for the detector's clock.
        def slowed(*args, **kwargs):
            t0 = time.perf_counter()
            out = forward(*args, **kwargs)
            if self.layer_sleep is None:
                self.layer_s.append(time.perf_counter() - t0)
            self._sleep(self.layer_sleep or 0.0)
            out = self._with_backward_sleep(out, 2 * (self.layer_sleep or 0.0))
            inner[0] += time.perf_counter() - t0
            return out

        return slowed

    def _slowed_chunk(self, i: int, forward, inner: list[float]):
        def slowed(*args, **kwargs):
            inner[0] = 0.0
            t0 = time.perf_counter()
            out = forward(*args, **kwargs)
            if self.layer_sleep is None:
                self.head_s.setdefault(i, []).append(time.perf_counter() - t0 - inner[0])
            head = self.head_sleep.get(i, 0.0)
            self._sleep(head)
            return self._with_backward_sleep(out, 2 * head)

        return slowed


class _SleepInBackward(torch.autograd.Function):
    """Identity; its backward sleeps ``seconds`` first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.seconds)
        return grad, None
