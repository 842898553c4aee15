"""The start-up breakdown of a training run, logged once as a ``startup`` record.

Parts, in the order a run goes through them (seconds each):

====================  ======================================================================
``spawn``             the launcher handing torchrun the job → this rank's Python starting
                      (``paratron train --nproc-per-node`` sets :data:`LAUNCH_ENV`)
``import_torch``      this rank's ``python -m paratron`` starting → ``import torch`` done
                      (``paratron/__main__.py`` sets :data:`PROCESS_ENV` and :data:`TORCH_ENV`)
``config``            ``import torch`` done → the training entry point: importing paratron,
                      reading and validating the config, the launcher's preflight checks
``rendezvous``        ``init_process_group`` and the layout's process groups
``data_index``        the data pipeline: tokenizer, index build or cache load, sampler
``model``             model build and init, DDP and optimizer
``checkpoint_load``   the checkpoint manager (importing ``torch.distributed.checkpoint``) and
                      ``checkpoint.load`` (its import only, when not resuming)
``first_step``        the first training step
====================  ======================================================================

``wall`` is measured on its own: from the launch (or this process's start when run without the
launcher; the parts before it are then absent) to the end of the first step. What the parts do
not cover (building the evaluator, callbacks and logs, measuring the peak FLOP/s) is the gap
between their sum and ``wall``. Each value is given for rank 0 and for the slowest rank.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

LAUNCH_ENV = "PARATRON_LAUNCH_TIME"
PROCESS_ENV = "PARATRON_PROCESS_START"
TORCH_ENV = "PARATRON_TORCH_IMPORTED"
PARTS = ("spawn", "import_torch", "config", "rendezvous", "data_index", "model", "checkpoint_load", "first_step")


def _env_time(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


class StartupClock:
    """Seconds per start-up part on this rank (see the module docstring).

    Wall-clock ``time.time()`` stamps, because the first parts span processes.
    """

    def __init__(self) -> None:
        launch, process, imported = (_env_time(n) for n in (LAUNCH_ENV, PROCESS_ENV, TORCH_ENV))
        self.origin = launch or process or time.time()
        self.seconds: dict[str, float] = {}
        if launch is not None and process is not None:
            self.seconds["spawn"] = max(0.0, process - launch)
        if process is not None and imported is not None:
            self.seconds["import_torch"] = imported - process
        if imported is not None:
            self.seconds["config"] = max(0.0, time.time() - imported)
        self.reported = False

    @contextmanager
    def part(self, name: str):
        """Time the ``with`` body as part ``name`` (one of :data:`PARTS`; repeats add up).

        Raises:
            KeyError: ``name`` is not a start-up part.
        """
        if name not in PARTS:
            raise KeyError(f"{name!r} is not a start-up part; known: {', '.join(PARTS)}")
        t0 = time.time()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.time() - t0

    def record(self, ctx) -> dict:
        """The ``startup`` record: ``{"record": "startup", "parts": {part: {"rank0": s,
        "slowest": s}}, "wall": {...}, "parts_sum": {...}}`` in seconds. Collective over
        ``ctx.world`` (one MAX and one SUM of a few floats on the CPU backend); call once, on
        every rank, after the first step."""
        wall = time.time() - self.origin
        mine = [self.seconds.get(p, 0.0) for p in PARTS] + [wall]
        slowest = torch.tensor(mine, dtype=torch.float64)
        ctx.world.host_all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        rank0 = torch.tensor(mine if ctx.rank == 0 else [0.0] * len(mine), dtype=torch.float64)
        ctx.world.host_all_reduce(rank0)
        self.reported = True
        both = {name: {"rank0": round(float(a), 4), "slowest": round(float(b), 4)}
                for name, a, b in zip(PARTS + ("wall",), rank0, slowest)}
        wall_both = both.pop("wall")
        parts = {p: both[p] for p in PARTS if p in self.seconds or both[p]["slowest"] > 0}
        return {"record": "startup", "parts": parts, "wall": wall_both,
                "parts_sum": {"rank0": round(sum(v["rank0"] for v in parts.values()), 4)}}

    @staticmethod
    def line(record: dict) -> str:
        """One console line: ``start-up 12.3s (slowest rank 12.9s): spawn 3.1, ...``."""
        parts = ", ".join(f"{k} {v['rank0']:.2f}/{v['slowest']:.2f}" for k, v in record["parts"].items())
        return (f"start-up {record['wall']['rank0']:.1f}s (slowest rank {record['wall']['slowest']:.1f}s), "
                f"seconds rank0/slowest: {parts}")
