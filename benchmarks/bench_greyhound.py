"""Greyhound level 3 (online re-layout of a slowed pipeline stage): the step time after the
re-layout against the slowed step before it, and against the simulator's prediction.

PP=2 (2 gloo ranks, one thread each), GPT with 6 layers, hidden 64, seq 64, micro-batch 1, global
batch 8 (8 microbatches, 1F1B); stage 1 slowed "2x" by sleep injection
(``PARATRON_SLOW_RANK=1:2``). ``FailSlow`` with ``train.failslow_relayout=true`` and its prior
re-layout cost (twice the step time until one is measured). The before and after steps come from
the same run, minutes apart at most, so the host's load is shared: slowed = the median step of
the decision's window (``measured_step_s``), after = the median ``step_time_s`` of the steps after
the re-layout (its first step left out), predicted = the decision's ``predicted_step_s`` (the
measured step times the simulated ratio for the per-layer costs measured in the run).

A second run per repeat ends the slowdown at step ``--recover-at`` and counts the re-layouts
after that (oscillation: more than one). Outputs go to a temporary directory.

    .venv/bin/python benchmarks/bench_greyhound.py [--iters 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_failslow import _corpus, _rank  # noqa: E402

MODEL = ["model.num_layers=6", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=64",
         "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16", "train.micro_batch_size=1",
         "train.global_batch_size=8", "parallel.pipeline=2", "train.eval_interval=0", "train.eval_iters=0",
         "train.deterministic=true", "train.seed=5", "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=1",
         "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false", "train.sample_tokens=0",
         "data.split=90,10,0", "train.elastic_relayout=true", "train.failslow_relayout=true",
         'train.callbacks=["paratron.plugins.failslow:FailSlow", "paratron.plugins.failslow_inject:SlowRank"]']


def _run(base: list[str], run_dir: Path, slow: str) -> list[dict]:
    from paratron.local_ranks import run_ranks

    run_ranks(_rank, 2, base, str(run_dir), slow, timeout=3000)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def _one(recs: list[dict]) -> dict | None:
    """The first re-layout's figures, or None when there was none."""
    d = next((r["failslow_decision"] for r in recs if "failslow_decision" in r), None)
    if d is None:
        return None
    after = [r["step_time_s"] for r in recs if r["iteration"] > d["iteration"] + 1]
    m = statistics.median(after)
    return {"at": d["iteration"], "layout": d["to"], "slowed": d["measured_step_s"], "predicted": d["predicted_step_s"],
            "after": m, "ratio": m / d["measured_step_s"], "vs_prediction": m / d["predicted_step_s"] - 1,
            "cost": next((r["failslow_effect"]["relayout_cost_s"] for r in recs if "failslow_effect" in r), None),
            "n_after": len(after)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--recover-at", type=int, default=14)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("load average before:", os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="bench_greyhound_") as tmp:
        base = MODEL + _corpus(Path(tmp)) + [f"train.train_iters={args.iters}"]
        for i in range(args.repeats):
            fig = _one(_run(base, Path(tmp) / f"slow{i}", "1:2"))
            print(f"run {i}: " + (", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in fig.items()) if fig else "no re-layout"), flush=True)
            rec = _run(base, Path(tmp) / f"recover{i}", f"1:2:{args.recover_at}")
            moves = [(r["failslow_decision"]["iteration"], r["failslow_decision"]["to"]) for r in rec
                     if "failslow_decision" in r]
            print(f"run {i}, slowdown ends after step {args.recover_at}: re-layouts {moves}", flush=True)
            print("load average:", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
