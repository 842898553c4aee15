"""Delay-aware 1F1B (CrossPipe) against 1F1B with a slow link between pipeline ranks 1 and 2, at
PP=4 on the CPU: measured makespan under 10/40/100 ms injected (``LinkDelay``), and the
simulator's prediction for both.

The stage compute is fixed-cost: each stage is one small transformer layer followed by a sleep of
``--f-ms`` in its forward and ``--b-ms`` in its backward, so the schedules' difference (waits on
the slow link) is what is timed, not how 4 ranks share 2 loaded cores. Calibration, ``--repeats``
1F1B steps without delay (after one untimed step): the microbatch time ``1f1b-delay`` divides the
latency by (:func:`~paratron.pipeline.delay.measured_microbatch_time`, max over ranks), and the
per-message time that makes the simulator reproduce those steps (gloo, the p2p batches' host work,
a loaded machine waking a rank). Per delay, the two schedules take turns for ``--repeats`` steps
each; each step's prediction takes each (stage, kind)'s mean duration from that same step's
timeline, the per-message time, and the injected delay on link 1, and replays the lists in the
simulator. The last two columns predict ahead of the run instead: costs from the calibration steps
only. Makespan: end of the last action of any rank, from the ranks' common start after a
barrier. The table gives medians over the repeats.

Usage::

    .venv/bin/python benchmarks/bench_pipeline_delay.py [--microbatches 8 --repeats 5 --f-ms 20 --b-ms 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paratron.config import ModelConfig  # noqa: E402
from paratron.models.gpt import build_model_chunks  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.pipeline.delay import LinkDelay, measured_microbatch_time  # noqa: E402
from paratron.pipeline.partition import stage_layers  # noqa: E402
from paratron.pipeline.registry import build_schedule  # noqa: E402
from paratron.pipeline.runtime import run_pipeline  # noqa: E402
from paratron.pipeline.simulator import Costs, simulate  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

VOCAB, P, HIDDEN, SEQ, MBS, DELAYS_MS = 128, 4, 32, 16, 1, (10, 40, 100)


class FixedCost(torch.autograd.Function):
    """Identity that sleeps ``f`` seconds in forward and ``b`` in backward: a stage's fixed cost."""

    @staticmethod
    def forward(ctx, x, f, b):
        ctx.b = b
        time.sleep(f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b)
        return grad, None, None


def _predict(lists, timeline, d: float, base: float = 0.0) -> float:
    """The simulator's makespan for ``lists`` with each (stage, kind)'s mean duration in
    ``timeline`` (every rank's events), ``base`` seconds per message and ``d`` more on link 1."""
    seen = defaultdict(list)
    for e in timeline:
        seen[(e.stage, e.kind)].append(e.end - e.start)
    mean = {k: statistics.mean(v) for k, v in seen.items()}
    costs = Costs(latency=base, link_latency=(0.0, d, 0.0))
    return simulate(lists, lambda a: mean[(a.stage, a.kind)], latency=costs.link_time).makespan


def _base_latency(lists, timeline) -> float:
    """The per-message time (gloo, the p2p batches' host work, waking a rank up on a loaded
    machine) that makes the simulator reproduce a run without injected delay: bisection."""
    lo, hi, target = 0.0, 0.1, _makespan(timeline)
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _predict(lists, timeline, 0.0, mid) < target else (lo, mid)
    return (lo + hi) / 2


def _makespan(timeline) -> float:
    """End of the last action of any rank, each rank's clock starting at its ``run_pipeline``
    call (the ranks enter it together, after a barrier)."""
    return max(e.end for e in timeline)


def _rank(a):
    ctx = ParallelContext.build(pp=P)
    cfg = ModelConfig(num_layers=P, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=VOCAB, seq_length=SEQ)
    chunks = build_model_chunks(cfg, ctx, seed=1, stage_layers=stage_layers(P, P, 1, None, "1f1b"))
    ids = torch.randint(0, VOCAB, (a.microbatches * MBS, SEQ), generator=torch.Generator().manual_seed(0))
    micro = [(ids[i * MBS:(i + 1) * MBS],) * 2 for i in range(a.microbatches)]
    f, b = a.f_ms / 1e3, a.b_ms / 1e3

    def step(c, chunk, x, mb):
        out = chunk(mb[0] if x is None else x, mb[1] if chunk.post_process else None)
        return FixedCost.apply(out.sum() / ids.numel() if chunk.post_process else out, f, b)

    def run(lists, delay):
        timeline = []
        dist.barrier()
        run_pipeline(lists[ctx.pp.rank], chunks, ctx if delay is None else delay.over(ctx), micro, step,
                     (SEQ, MBS, HIDDEN), torch.float32, timeline=timeline)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        everyone = [None] * P
        dist.all_gather_object(everyone, timeline)
        return [e for events in everyone for e in events if e.lane == ""]  # actions, not intervals in them

    plain = build_schedule("1f1b", P, a.microbatches)
    run(plain, None)  # gloo's first messages between two ranks take seconds: not timed
    calibration = [run(plain, None) for _ in range(a.repeats)]
    t = statistics.median(max(measured_microbatch_time([e for e in tl if e.rank == r], a.microbatches)
                              for r in range(P)) for tl in calibration)
    base = statistics.median(_base_latency(plain, tl) for tl in calibration)
    rows = []
    for ms in DELAYS_MS:
        d = ms / 1e3
        lists = {"1f1b": plain,
                 "1f1b-delay": build_schedule("1f1b-delay", P, a.microbatches, link_latency=[0, d, 0],
                                              microbatch_time=t)}
        got = {name: ([], []) for name in lists}
        for s in range(a.repeats):
            for name in (["1f1b", "1f1b-delay"] if s % 2 else ["1f1b-delay", "1f1b"]):
                timeline = run(lists[name], LinkDelay((1, 2), d))
                got[name][0].append(_makespan(timeline))
                got[name][1].append(_predict(lists[name], timeline, d, base))
        ahead = [_predict(lists[n], [e for tl in calibration for e in tl], d, base) for n in lists]
        rows.append((ms, *(statistics.median(got[n][i]) for n in lists for i in (0, 1)), *ahead))
    return t, base, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("microbatches", 8), ("repeats", 5), ("f-ms", 20.0), ("b-ms", 40.0)):
        ap.add_argument(f"--{name}", type=type(default), default=default)
    a = ap.parse_args()
    load = os.getloadavg()
    t, base, rows = run_ranks(_rank, P, a, timeout=1800)[0]
    print(f"load average before {load}, after {os.getloadavg()}; PP={P}, m={a.microbatches}, fixed cost "
          f"F {a.f_ms} ms + B {a.b_ms} ms per stage; without delay: microbatch time {t * 1e3:.1f} ms, "
          f"per-message time {base * 1e3:.2f} ms; medians of {a.repeats} steps")
    print("| delay (ms) | 1f1b measured (s) | 1f1b predicted (s) | 1f1b-delay measured (s) | "
          "1f1b-delay predicted (s) | ratio measured | ratio predicted | measured/predicted 1f1b | "
          "measured/predicted 1f1b-delay | same, costs from the calibration only: 1f1b | 1f1b-delay |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ms, m1, p1, m2, p2, a1, a2 in rows:
        print(f"| {ms} | {m1:.3f} | {p1:.3f} | {m2:.3f} | {p2:.3f} | {m2 / m1:.3f} | {p2 / p1:.3f} | "
              f"{m1 / p1:.3f} | {m2 / p2:.3f} | {m1 / a1:.3f} | {m2 / a2:.3f} |")


if __name__ == "__main__":
    main()
