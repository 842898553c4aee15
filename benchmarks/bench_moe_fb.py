"""Cross-microbatch F/B overlap in the pipeline runtime (``parallel.overlap_moe_expert_parallel_comm``)
against the plain schedule, at EP=2 (2 ranks, one pipeline stage each, 1F1B).

Model: ``bench_moe.py``'s (2 layers, h=128, 8 SwiGLU experts of width 256, top-2, MoE in every
layer, seq 128), global batch 8 samples in microbatches of 1, so each rank runs 4 microbatches
and the overlapped list pairs the forward of microbatch i+1 with the backward of microbatch i
(3 pairs). One training step = ``run_global_batch`` (the pipeline runtime) + the optimizer step.
Step time: median of ``--steps`` steps on the slowest rank after 2 warm-up steps, the two lists
alternating for ``--rounds`` rounds (each round builds the model afresh). Hidden fraction: in
``--steps`` further steps the runtime records its intervals (:mod:`paratron.parallel.intervals`);
the forward dispatch/combine all-to-alls, from issue to completion, against all compute recorded
(expert forward/backward and, in pairs, the backward segments of the other microbatch).

Run: ``.venv/bin/python benchmarks/bench_moe_fb.py [--rounds 3] [--steps 4]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import FARSKIP_OVERLAP, FORWARD, GBS, SEQ, VOCAB, _config, _hidden  # noqa: E402
from paratron.rules import validate  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

EP = 2


def _steps(overlap: bool, steps: int):
    """On every rank: median step seconds (wall, CPU of the process), and the intervals recorded
    in ``steps`` more steps."""
    from paratron.parallel.intervals import recording
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import rank_actions, run_global_batch

    cfg = _config(EP, "alltoall", EP)
    cfg.train.micro_batch_size = 1
    cfg.parallel.overlap_moe_expert_parallel_comm = overlap
    validate(cfg, EP)
    ctx = ParallelContext.build(ep=EP)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (GBS, SEQ), generator=g) for _ in range(2))
    rows = GBS // ctx.dp.size
    mbs = [{"tokens": tokens[i:i + 1], "labels": labels[i:i + 1]}
           for i in range(ctx.dp.rank * rows, (ctx.dp.rank + 1) * rows)]
    actions = rank_actions(cfg, ctx, len(mbs))

    def one_step(timeline=None):
        optimizer.zero_grad()
        run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, loss_scale=optimizer.loss_scale, ddp=ddp,
                         actions=actions, timeline=timeline)
        optimizer.step()

    times, cpu = [], []
    for step in range(steps + 2):
        t0, c0 = time.perf_counter(), time.process_time()
        one_step()
        if step >= 2:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    with recording(ctx.ledger) as rec:  # separate steps: the recorder stays out of the timings
        for _ in range(steps):
            one_step(timeline=[])
    return statistics.median(times), statistics.median(cpu), rec.take()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    print(f"load average: {os.getloadavg()}")
    names = {"plain 1F1B": False, "FB pairs": True}
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    hidden = {n: [0.0, 0.0] for n in names}
    for r in range(args.rounds):
        for n, overlap in names.items():
            res = run_ranks(_steps, EP, overlap, args.steps, timeout=900)
            wall[n].append(max(t for t, _, _ in res))
            cpu[n].append(max(c for _, c, _ in res))
            h, tot = _hidden([ivs for _, _, ivs in res], FORWARD)
            hidden[n][0] += h
            hidden[n][1] += tot
            print(f"round {r}: {n}: {wall[n][-1] * 1e3:.1f} ms/step, cpu {cpu[n][-1] * 1e3:.1f} ms/step, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    print("\n| schedule | wall, median (ms) | wall, best (ms) | CPU busiest rank, median (ms) "
          "| forward all-to-all (ms/step/rank) | hidden, forward all-to-all |\n|---|---|---|---|---|---|")
    for n in names:
        h, tot = hidden[n]
        print(f"| {n} | {statistics.median(wall[n]) * 1e3:.1f} | {min(wall[n]) * 1e3:.1f} | "
              f"{statistics.median(cpu[n]) * 1e3:.1f} | "
              f"{tot / (EP * args.rounds * args.steps) * 1e3:.2f} | **{h / max(tot, 1e-12):.1%}** |")
    a, b = wall["FB pairs"], wall["plain 1F1B"]
    ca, cb = cpu["FB pairs"], cpu["plain 1F1B"]
    print(f"\nFB / plain wall: median {statistics.median(a) / statistics.median(b):.2f}, best "
          f"{min(a) / min(b):.2f}; CPU {statistics.median(ca) / statistics.median(cb):.2f}. "
          f"FarSkip-Collective reports {FARSKIP_OVERLAP:.1%} overlap.")
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
