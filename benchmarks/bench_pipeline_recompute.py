"""Recompute placed in bubbles (Obscura) against plain full recompute, at PP=2 on the CPU, and
predicted at p=8 by the simulator.

Both variants run the same 1F1B action lists with an ``R`` per backward: plain full recompute
puts each ``R`` right before its backward (``with_full_recompute``); the placed variant moves
them into the waits (``place_recompute``, memory budget 1 activation, placed with F=1, R=1,
BW=2). Step time: from a barrier to the end of the slowest rank, the two variants taking turns
(which goes first alternates); the ratio is the median over steps of placed / full in the same
step. Prediction: the mean F, R and BW durations measured by the runtime's timeline feed
``simulate`` for the lists that ran (p=2) and for p=8, m=16 (the same per-stage costs).

``--f-ms``/``--b-ms`` > 0 add a fixed cost to each stage (a sleep in its forward, and so in each
``R``, and in its backward; ``bench_pipeline_delay.FixedCost``): with a small model the step is
then set by the schedule rather than by how the ranks share loaded cores, and a rank waiting on
a receive really idles, which is the time the placed ``R`` fills.

Usage::

    .venv/bin/python benchmarks/bench_pipeline_recompute.py [--layers 8 --hidden 128 --seq 128 --mbs 2 \\
        --microbatches 8 --steps 10]
    .venv/bin/python benchmarks/bench_pipeline_recompute.py --layers 2 --hidden 32 --seq 16 --mbs 1 \\
        --f-ms 20 --b-ms 40
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
from paratron.pipeline.partition import stage_layers  # noqa: E402
from paratron.pipeline.recompute_placement import place_recompute, with_full_recompute  # noqa: E402
from paratron.pipeline.registry import build_schedule  # noqa: E402
from paratron.pipeline.runtime import run_pipeline  # noqa: E402
from paratron.pipeline.simulator import Costs, simulate  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

from bench_pipeline_delay import FixedCost  # noqa: E402

VOCAB = 512
PLACE_COSTS = Costs(F=1, B=2, W=0, BW=2, R=1)


def variants(p: int, m: int) -> dict[str, list]:
    full = with_full_recompute(build_schedule("1f1b", p, m, 1))
    return {"full": full, "placed": place_recompute(full, 1, PLACE_COSTS)}


def _rank(a):
    ctx = ParallelContext.build(pp=2)
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=max(a.hidden // 64, 1),
                      vocab_size=VOCAB, seq_length=a.seq)
    chunks = build_model_chunks(cfg, ctx, seed=1, stage_layers=stage_layers(a.layers, 2, 1, None, "1f1b"))
    lists = {k: v[ctx.pp.rank] for k, v in variants(2, a.microbatches).items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (a.microbatches * a.mbs, a.seq), generator=g)
    micro = [(ids[i * a.mbs:(i + 1) * a.mbs], ids[i * a.mbs:(i + 1) * a.mbs]) for i in range(a.microbatches)]
    total, f, b = ids.numel(), a.f_ms / 1e3, a.b_ms / 1e3

    def step(c, chunk, x, mb):
        out = chunk(mb[0] if x is None else x, mb[1] if chunk.post_process else None)
        out = out.sum() / total if chunk.post_process else out
        return FixedCost.apply(out, f, b) if f or b else out

    times, durations = defaultdict(list), defaultdict(list)
    for s in range(a.steps + 1):
        order = ["full", "placed"] if s % 2 else ["placed", "full"]
        for name in order:
            timeline = []
            dist.barrier()
            t0 = time.perf_counter()
            run_pipeline(lists[name], chunks, ctx, micro, step, (a.seq, a.mbs, a.hidden), torch.float32,
                         timeline=timeline)
            elapsed = time.perf_counter() - t0
            for c in chunks:
                c.zero_grad(set_to_none=True)
            if s:  # step 0 warms up
                times[name].append(elapsed)
                for e in timeline:
                    if e.kind in ("F", "R", "BW"):
                        durations[e.kind].append(e.end - e.start)
    return dict(times), {k: statistics.mean(v) for k, v in durations.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("layers", 8), ("hidden", 128), ("seq", 128), ("mbs", 2), ("microbatches", 8), ("steps", 10)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--f-ms", type=float, default=0.0)
    ap.add_argument("--b-ms", type=float, default=0.0)
    a = ap.parse_args()
    results = run_ranks(_rank, 2, a, timeout=1800)
    steps = {k: [max(r[0][k][i] for r in results) for i in range(a.steps)] for k in ("full", "placed")}
    ratio = statistics.median(p / f for p, f in zip(steps["placed"], steps["full"]))
    cost = {k: statistics.mean(r[1][k] for r in results) for k in ("F", "R", "BW")}
    measured = Costs(F=cost["F"], B=cost["BW"], W=0, BW=cost["BW"], R=cost["R"])
    print(f"load average: {os.getloadavg()}")
    print(f"measured step time: full {statistics.median(steps['full']) * 1e3:.1f} ms, placed "
          f"{statistics.median(steps['placed']) * 1e3:.1f} ms, ratio placed/full {ratio:.3f}")
    print(f"mean action costs (ms): F {cost['F'] * 1e3:.2f}  R {cost['R'] * 1e3:.2f}  BW {cost['BW'] * 1e3:.2f}")
    for p, m in ((2, a.microbatches), (8, 16)):
        sims = {k: simulate(v, measured).makespan for k, v in variants(p, m).items()}
        print(f"simulated p={p} m={m}: full {sims['full'] * 1e3:.1f} ms, placed {sims['placed'] * 1e3:.1f} ms, "
              f"ratio {sims['placed'] / sims['full']:.3f}")


if __name__ == "__main__":
    main()
