"""Delay-aware 1F1B (CrossPipe) against 1F1B with a slow link between pipeline ranks 1 and 2, at
PP=4 on the CPU: measured makespan under 10/40/100 ms injected (``LinkDelay``), and the
simulator's prediction for both from the measured per-action costs.

A calibration step without delay measures each rank's mean F and BW (max over ranks); ``1f1b-delay``
gets ``link_latency=[0, d, 0]`` and ``microbatch_time = F + BW``. Per delay, the two schedules take
turns for ``--steps`` steps; makespan: barrier to the end of the slowest rank, median.

Usage::

    .venv/bin/python benchmarks/bench_pipeline_delay.py [--layers 8 --hidden 64 --seq 64 --mbs 2 \\
        --microbatches 8 --steps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paratron.config import ModelConfig  # noqa: E402
from paratron.models.gpt import build_model_chunks  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.pipeline.delay import LinkDelay  # noqa: E402
from paratron.pipeline.partition import stage_layers  # noqa: E402
from paratron.pipeline.registry import build_schedule  # noqa: E402
from paratron.pipeline.runtime import run_pipeline  # noqa: E402
from paratron.pipeline.simulator import Costs, simulate  # noqa: E402
from paratron.testing import run_ranks  # noqa: E402

VOCAB, P, DELAYS_MS = 512, 4, (10, 40, 100)


def _rank(a):
    ctx = ParallelContext.build(pp=P)
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=max(a.hidden // 64, 1),
                      vocab_size=VOCAB, seq_length=a.seq)
    chunks = build_model_chunks(cfg, ctx, seed=1, stage_layers=stage_layers(a.layers, P, 1, None, "1f1b"))
    ids = torch.randint(0, VOCAB, (a.microbatches * a.mbs, a.seq), generator=torch.Generator().manual_seed(0))
    micro = [(ids[i * a.mbs:(i + 1) * a.mbs],) * 2 for i in range(a.microbatches)]

    def step(c, chunk, x, mb):
        out = chunk(mb[0] if x is None else x, mb[1] if chunk.post_process else None)
        return out.sum() / ids.numel() if chunk.post_process else out

    def run(lists, delay):
        timeline = []
        dist.barrier()
        t0 = time.perf_counter()
        run_pipeline(lists[ctx.pp.rank], chunks, ctx, micro, step, (a.seq, a.mbs, a.hidden), torch.float32,
                     timeline=timeline, link_delay=delay)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        span = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        return span.item(), timeline

    plain = build_schedule("1f1b", P, a.microbatches)
    run(plain, None)
    _, timeline = run(plain, None)
    cost = torch.tensor([statistics.mean(e.end - e.start for e in timeline if e.kind == k) for k in ("F", "BW")])
    dist.all_reduce(cost, op=dist.ReduceOp.MAX)
    f, bw = cost.tolist()
    rows = []
    for ms in DELAYS_MS:
        d = ms / 1e3
        aware = build_schedule("1f1b-delay", P, a.microbatches, link_latency=[0, d, 0], microbatch_time=f + bw)
        times = {"1f1b": [], "1f1b-delay": []}
        for s in range(a.steps):
            for name in (["1f1b", "1f1b-delay"] if s % 2 else ["1f1b-delay", "1f1b"]):
                times[name].append(run(plain if name == "1f1b" else aware, LinkDelay((1, 2), d))[0])
        sim_costs = Costs(F=f, B=bw, W=0, BW=bw, link_latency=(0, d, 0))
        rows.append((ms, statistics.median(times["1f1b"]), statistics.median(times["1f1b-delay"]),
                     simulate(plain, sim_costs).makespan, simulate(aware, sim_costs).makespan))
    return f, bw, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 8), ("hidden", 64), ("seq", 64), ("mbs", 2), ("microbatches", 8), ("steps", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    f, bw, rows = run_ranks(_rank, P, a, timeout=1800)[0]
    print(f"load average: {os.getloadavg()}; F {f * 1e3:.1f} ms, BW {bw * 1e3:.1f} ms per stage")
    print("| delay (ms) | 1f1b (s) | 1f1b-delay (s) | measured ratio | predicted 1f1b | predicted delay | "
          "predicted ratio | measured/predicted 1f1b | measured/predicted delay |")
    for ms, t1, t2, s1, s2 in rows:
        print(f"| {ms} | {t1:.3f} | {t2:.3f} | {t2 / t1:.3f} | {s1:.3f} | {s2:.3f} | {s2 / s1:.3f} | "
              f"{t1 / s1:.2f} | {t2 / s2:.2f} |")


if __name__ == "__main__":
    main()
