"""What the hang watchdog and its ring buffer cost per training step.

At layout (1) (one process) every group has size 1: collectives return before the ledger hook and
the training loop builds no watchdog, so the cost is nil by construction; the script checks that
no op is recorded. At TP=2 x PP=2 (4 gloo ranks, the main job's model, one thread each) it times
the training step with the watchdog off and on, in interleaved rounds inside the same ranks, and
also prices the hook directly: ops per step x the measured cost of one ``begin``/``finish``, plus
the watchdog thread's polls during a step.

    .venv/bin/python benchmarks/bench_watchdog.py [--rounds 6] [--steps 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paratron.parallel.flight import FlightRecorder  # noqa: E402


def _setup(tp: int, pp: int):
    from paratron.rules import load_config
    from paratron.parallel.context import ParallelContext
    from paratron.training.builders import build_model_and_optimizer

    cfg = load_config(ROOT / "configs/default.toml", [f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
                                                       "model.vocab_size=8192"])
    if tp * pp == 1:
        cfg.parallel.sequence_parallel = False
        ctx = ParallelContext.single()
    else:
        ctx = ParallelContext.build(tp=tp, pp=pp)
    torch.manual_seed(0)
    chunks, ddp, opt, _ = build_model_and_optimizer(cfg, ctx)
    g = torch.Generator().manual_seed(1)
    dp = ctx.grid.dp
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    mbs = [{"tokens": torch.randint(0, 8192, (b, s), generator=g),
            "labels": torch.randint(0, 8192, (b, s), generator=g)} for _ in range(m)]
    return cfg, ctx, chunks, ddp, opt, mbs


def _rounds(rounds: int, steps: int, tp: int, pp: int) -> dict:
    from paratron.training.step import run_global_batch
    from paratron.launch.watchdog import HangWatchdog

    cfg, ctx, chunks, ddp, opt, mbs = _setup(tp, pp)

    def step():
        opt.zero_grad()
        run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, ddp=ddp)
        opt.step()

    run_dir = tempfile.mkdtemp(prefix="bench-watchdog-")
    state = SimpleNamespace(ctx=ctx, run_dir=Path(run_dir), iteration=0)
    step()  # warm-up
    off, on, ops = [], [], 0
    for _ in range(rounds):
        ctx.world.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ctx.world.barrier()
        off.append((time.perf_counter() - t0) / steps)
        wd = HangWatchdog(state, timeout_s=300.0)
        wd.on_train_start(state)
        t0 = time.perf_counter()
        for _ in range(steps):
            wd.on_step_start(state)
            step()
            wd.on_step_end(state, {}, {})
        ops = sum(wd.recorder.counts.values()) // steps
        ctx.world.barrier()
        on.append((time.perf_counter() - t0) / steps)
        wd.stop()
    return {"off_s": statistics.median(off), "on_s": statistics.median(on),
            "ratio": statistics.median(b / a for a, b in zip(off, on)), "ops_per_step": ops}


def hook_cost_s(n: int = 20000) -> float:
    """Seconds for one ``begin`` + ``finish`` of the ring buffer (a [16, 2, 256] fp32 payload)."""
    fr, t = FlightRecorder(), torch.zeros(16, 2, 256)
    t0 = time.perf_counter()
    for _ in range(n):
        fr.finish(fr.begin("all_reduce", "tp", (0, 1), t))
    return (time.perf_counter() - t0) / n


def poll_cost_s(n: int = 200) -> float:
    """Seconds for one watchdog poll over a full ring buffer of 256 entries."""
    fr, t = FlightRecorder(), torch.zeros(4)
    for _ in range(256):
        fr.finish(fr.begin("all_reduce", "tp", (0, 1), t))
    t0 = time.perf_counter()
    for _ in range(n):
        fr.poll()
        fr.pending()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    hook, poll = hook_cost_s(), poll_cost_s()
    print(f"one ring-buffer entry (begin + finish): {hook * 1e6:.2f} us; one watchdog poll: {poll * 1e6:.1f} us")
    single = _rounds(args.rounds, args.steps, 1, 1)
    print(f"layout (1): step {single['off_s']:.3f} s off / {single['on_s']:.3f} s on, ratio {single['ratio']:.3f}, "
          f"ops recorded per step {single['ops_per_step']}")
    from paratron.local_ranks import run_ranks

    res = run_ranks(_rounds, 4, args.rounds, args.steps, 2, 2, timeout=3000)[0]
    predicted = (res["ops_per_step"] * hook + poll * res["on_s"] / 1.0) / res["off_s"]
    print(f"tp2 x pp2 (4 ranks), rank 0: step {res['off_s']:.3f} s off / {res['on_s']:.3f} s on, "
          f"median per-round ratio {res['ratio']:.3f}; {res['ops_per_step']} ops per step -> priced cost "
          f"{predicted * 100:.3f}% of the step")


if __name__ == "__main__":
    main()
