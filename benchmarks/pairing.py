"""Paired, order-alternated step timing shared by the benchmarks, and the sizes they run at.

Every benchmark that compares paratron with a baseline on this shared machine times them with
:func:`time_paired`: each timed step runs every variant once, back to back, in an order that is
reversed every other step (so neither variant always runs first, right after a barrier or a
cache-cold switch), and :func:`summarize` reports, per variant, the median step time and the
*paired* ratio against the baseline: the median, over steps, of ``variant[step] / base[step]``
(both ran within the same fraction of a second, so machine load hits them alike), with its
spread (25th-75th percentile and min-max over steps). :func:`load` records ``os.getloadavg()``
before and after a run; a report without it is not comparable.

``--size small|large`` (:func:`add_size_arg`): ``small`` is the size each benchmark always ran at
(overhead-bound on this CPU); ``large`` is one where compute dominates (hidden size >= 512 or
>= 16x the params), as each benchmark's docstring states.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

MIN_TIMED_STEPS = 30


def load() -> list[float]:
    """The 1-, 5- and 15-minute load averages now (rounded)."""
    return [round(x, 2) for x in os.getloadavg()]


def add_size_arg(ap, default: str = "small") -> None:
    """``--size small|large`` on an ``argparse`` parser (see the module docstring)."""
    ap.add_argument("--size", choices=("small", "large"), default=default,
                    help="small: the overhead-bound size; large: a size where compute dominates")


def slowest_rank(seconds: float) -> float:
    """The largest ``seconds`` over the default process group (every rank must call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def time_paired(names, steps: int, run_step, *, warmup: int = 3, sync=_barrier,
                reduce=slowest_rank) -> dict[str, list[float]]:
    """Time ``run_step(name, step)`` for every name, ``warmup + steps`` steps, the order of the
    names reversed on every odd step.

    Args:
        names: the variants (the first is usually the baseline).
        steps: timed steps per variant (>= :data:`MIN_TIMED_STEPS` for a reported figure).
        run_step: ``(name, step) -> None``; the same ``step`` gives every variant the same data.
        warmup: untimed steps first.
        sync: called before each timed call (default: a barrier when a process group exists).
        reduce: maps this process's seconds to the reported seconds (default: the slowest rank).

    Returns:
        ``{name: [seconds of each timed step]}``, steps in order (pairs line up by index).
    """
    names = list(names)
    times: dict[str, list[float]] = {n: [] for n in names}
    for step in range(warmup + steps):
        for name in (names if step % 2 == 0 else names[::-1]):
            sync()
            t0 = time.perf_counter()
            run_step(name, step)
            t = reduce(time.perf_counter() - t0)
            if step >= warmup:
                times[name].append(t)
    return times


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def paired_ratio(times: list[float], base: list[float]) -> dict[str, float]:
    """Median of the per-step ratios ``times[i] / base[i]`` with its spread: 25th/75th
    percentiles and min/max over steps."""
    r = [a / b for a, b in zip(times, base)]
    return {"median": round(statistics.median(r), 3), "p25": round(_quantile(r, 0.25), 3),
            "p75": round(_quantile(r, 0.75), 3), "min": round(min(r), 3), "max": round(max(r), 3)}


def summarize(times: dict[str, list[float]], base: str | None = None, pairs=None) -> dict:
    """Median ms per variant and paired ratios: every variant against ``base`` (default: the
    first name) and any extra ``(numerator, denominator)`` pairs."""
    names = list(times)
    base = base or names[0]
    out = {"steps": len(times[base]),
           "median_ms": {n: round(statistics.median(v) * 1e3, 2) for n, v in times.items()},
           "paired_vs_" + base: {n: paired_ratio(v, times[base]) for n, v in times.items() if n != base}}
    for a, b in pairs or ():
        out[f"paired_{a}_vs_{b}"] = paired_ratio(times[a], times[b])
    return out


def fmt_ratio(r: dict[str, float]) -> str:
    """``0.93 [0.90-0.97]``: the paired median and its interquartile range."""
    return f"{r['median']:.3f} [{r['p25']:.3f}-{r['p75']:.3f}]"
