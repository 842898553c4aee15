"""``paratron plan --calibrate``: measure what the CPU cost model needs, with every rank busy at once.

Measured on ``nproc`` forked gloo ranks (:func:`paratron.local_ranks.run_ranks`), one thread each,
all running together as a training run's ranks do, so the figures are each rank's share of the
cores under that load (and under whatever else runs on the machine: calibrate when it is as
loaded as it will be for the runs):

* ``gemm_flops``: fp32 ``[1024, 512] x [512, 512]`` matmuls, the median of 15 (FLOPs = 2 m n k);
* ``cores``: the cores this process may run on (``os.sched_getaffinity``); with more ranks than
  cores a rank idling in a pipeline bubble lends its core to the others (``Hardware.sharing``);
* ``mem_bandwidth``: an in-place add of two 4M-element fp32 tensors (3 x 16 MB moved), median;
* ``op_overhead``: a chain of 200 tiny autograd ops, forward and backward, per op;
* ``gloo_bandwidth`` and ``gloo_latency``: all-reduces of 1 KB and 16 MB over all ranks, solved
  for the ring model of :mod:`.communication` (``t = 2 (n-1)/n x / B + 2 (n-1) l``).

The medians over ranks are written as JSON; ``--gpu cpu`` plans read them. Rank 0 shows a
progress bar over these five measurements on a terminal (:func:`paratron.progress.progress_bar`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from paratron.local_ranks import run_ranks
from paratron.progress import progress_bar

MEASUREMENTS = ("GEMM", "memory bandwidth", "autograd op overhead", "gloo all-reduce 1 KB",
                "gloo all-reduce 16 MB")
"""What each rank measures, in order (the progress bar's steps; the cores are read, not timed)."""


def _typical_time(fn, trials: int) -> float:
    """The median of ``trials`` calls: a training step is a long sum of such calls, slowed down by
    the other ranks and by other work just as often as these are."""
    fn()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank_measure(quiet: bool = True) -> dict:
    import torch.distributed as dist

    with progress_bar(len(MEASUREMENTS), "calibrate", quiet=quiet or dist.get_rank() != 0) as bar:
        return _measure(bar)


def _measure(bar) -> dict:
    """The figures of the module docstring on this rank; ``bar`` advances after each."""
    import torch
    import torch.distributed as dist

    def step(name: str, value: float) -> float:
        bar.set_postfix_str(f"{name} done", refresh=False)
        bar.update()
        return value

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 512, generator=g), torch.randn(512, 512, generator=g)
    gemm = step(MEASUREMENTS[0], 2 * 1024 * 512 * 512 / _typical_time(lambda: torch.mm(a, b), 15))
    x, y = torch.randn(4 * 2**20, generator=g), torch.randn(4 * 2**20, generator=g)
    mem = step(MEASUREMENTS[1], 3 * x.numel() * 4 / _typical_time(lambda: x.add_(y), 15))

    def chain():
        z = torch.ones(4, requires_grad=True)
        w = z
        for _ in range(200):
            w = w * 1.0001
        w.sum().backward()

    op = step(MEASUREMENTS[2], _typical_time(chain, 7) / 400)
    n = dist.get_world_size()
    small, big = torch.zeros(256), torch.zeros(4 * 2**20)
    dist.barrier()
    t_small = step(MEASUREMENTS[3], _typical_time(lambda: dist.all_reduce(small), 21))
    t_big = step(MEASUREMENTS[4], _typical_time(lambda: dist.all_reduce(big), 7))
    ring = 2 * (n - 1) / n
    bw = ring * (big.numel() - small.numel()) * 4 / max(t_big - t_small, 1e-9)
    lat = max(t_small - ring * small.numel() * 4 / bw, 1e-7) / (2 * (n - 1))
    return {"gemm_flops": gemm, "mem_bandwidth": mem, "op_overhead": op, "gloo_bandwidth": bw, "gloo_latency": lat}


def calibrate(nproc: int, quiet: bool = True) -> dict:
    """Medians over ``nproc`` ranks of each figure (module docstring), plus ``nproc``; unless
    ``quiet``, rank 0 draws a progress bar (on a terminal)."""
    per_rank = run_ranks(_rank_measure, nproc, quiet, timeout=600)
    out = {k: statistics.median(r[k] for r in per_rank) for k in per_rank[0]}
    out["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out["nproc"] = nproc
    return out


def load(path: str | Path) -> dict:
    """Read a calibration file.

    Raises:
        ValueError: the file is missing (run ``paratron plan --calibrate``) or lacks a figure.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--calibration={str(p)!r} does not exist: run `paratron plan --calibrate` first")
    data = json.loads(p.read_text())
    missing = {"gemm_flops", "mem_bandwidth", "op_overhead", "gloo_bandwidth", "gloo_latency"} - set(data)
    if missing:
        raise ValueError(f"--calibration={str(p)!r} lacks {sorted(missing)}: run `paratron plan --calibrate` again")
    return data
