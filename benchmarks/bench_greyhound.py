"""Greyhound level 3 (online re-layout of a slowed pipeline stage): the step time after the
re-layout against the slowed step before it, and against the simulator's prediction; and, with
the delay removed part-way, whether the layout oscillates.

PP=2 (2 gloo ranks, one thread each), GPT with 6 layers, hidden 128, seq 64, micro-batch 1, global
batch 8 (8 microbatches, 1F1B). Stage 1 slowed 2x by ``PARATRON_SLOW_RANK=1:2``: steps 1-2 at full
speed calibrate fixed sleeps (``paratron/plugins/failslow_inject.py``), from step 3 on every layer
and the head of stage 1 sleep once their calibrated forward (and twice it in the backward).
``FailSlow`` with ``train.failslow_relayout=true`` and a prior re-layout cost of 1 s
(``train.failslow_relayout_cost_s``; the measured one is 0.05-0.2 s), so that the budget buys
within a few steps of the flag even at the slow steps of a loaded host.

Figures, all from ``step_time_s`` of the same run (the host's load is shared): slowed = the
median step from step 4 to the decision; after = the median step from 3 steps after the
re-layout to the end; predicted = the simulator's prediction for that slowed step: slowed minus
the simulated saving (``simulated_now_s - simulated_then_s`` of the decision, from the per-layer
and non-layer costs the plugin measured; the unmodelled rest of the step stays). The plugin's own
``failslow_effect`` (3-step windows) is printed too.

The second run of each repeat ends the slowdown after step ``--recover-at`` and lists every
re-layout: oscillation is any re-layout after the return to the starting layout. The two runs
alternate order between repeats. Outputs go to a temporary directory.

    .venv/bin/python benchmarks/bench_greyhound.py [--iters 50] [--repeats 1] [--recover-at 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_failslow import _corpus, _rank  # noqa: E402

from paratron.plugins.failslow_layout import predicted_step  # noqa: E402

MODEL = ["model.num_layers=6", "model.hidden_size=128", "model.num_attention_heads=4", "model.seq_length=64",
         "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16", "train.micro_batch_size=1",
         "train.global_batch_size=8", "parallel.pipeline=2", "train.eval_interval=0", "train.eval_iters=0",
         "train.deterministic=true", "train.seed=5", "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=1",
         "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false", "train.sample_tokens=0",
         "data.split=90,10,0", "train.elastic_relayout=true", "train.failslow_relayout=true",
         'train.callbacks=["paratron.plugins.failslow:FailSlow", "paratron.plugins.failslow_inject:SlowRank"]']
FIRST_SLOWED = 4  # steps 1-2 calibrate, step 3 is the first slowed one: left out as a warm-up
SETTLE = 3  # steps after a re-layout left out (its first step builds, then the load settles)


def _run(base: list[str], run_dir: Path, slow: str) -> list[dict]:
    from paratron.local_ranks import run_ranks

    run_ranks(_rank, 2, base, str(run_dir), slow, timeout=3000)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def _figures(recs: list[dict]) -> dict | None:
    """The first re-layout's figures, or None when there was none."""
    d = next((r["failslow_decision"] for r in recs if "failslow_decision" in r), None)
    if d is None:
        return None
    slowed = [r["step_time_s"] for r in recs if FIRST_SLOWED <= r["iteration"] <= d["iteration"]]
    after = [r["step_time_s"] for r in recs if r["iteration"] > d["iteration"] + SETTLE]
    s, a = statistics.median(slowed), statistics.median(after)
    p = predicted_step(s, d["simulated_now_s"], d["simulated_then_s"])
    effect = next((r["failslow_effect"] for r in recs if "failslow_effect" in r), {})
    return {"at": d["iteration"], "layout": d["to"], "slowed_s": s, "n_slowed": len(slowed), "after_s": a,
            "n_after": len(after), "predicted_s": p, "after/slowed": a / s, "after/predicted-1": a / p - 1,
            "spread_after": (min(after), max(after)), "plugin_effect_error": effect.get("prediction_error"),
            "relayout_s": effect.get("relayout_cost_s"), "per_layer_s": d["per_layer_s"], "fixed_s": d["fixed_s"]}


def _moves(recs: list[dict]) -> list[tuple[int, str, list[int]]]:
    return [(r["iteration"], r["failslow_decision"]["reason"], r["failslow_decision"]["to"]) for r in recs
            if "failslow_decision" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--recover-at", type=int, default=20)
    ap.add_argument("--keep", type=Path, default=None, help="write the runs here (kept) instead of a temporary dir")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with (contextlib.nullcontext(str(args.keep)) if args.keep else
          tempfile.TemporaryDirectory(prefix="bench_greyhound_")) as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        base = MODEL + _corpus(Path(tmp)) + [f"train.train_iters={args.iters}"]
        for i in range(args.repeats):
            order = ["slow", "recover"] if i % 2 == 0 else ["recover", "slow"]
            for kind in order:
                print(f"load average before run {i} {kind}: {os.getloadavg()}", flush=True)
                if kind == "slow":
                    fig = _figures(_run(base, Path(tmp) / f"slow{i}", "1:2"))
                    print(f"run {i}: " + (", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in fig.items()) if fig else "no re-layout"), flush=True)
                else:
                    moves = _moves(_run(base, Path(tmp) / f"recover{i}", f"1:2:{args.recover_at}"))
                    back = next((k for k, m in enumerate(moves) if m[1] == "recovered"), None)
                    print(f"run {i}, slowdown ends after step {args.recover_at}: re-layouts {moves}; "
                          f"oscillation: {back is not None and back < len(moves) - 1}", flush=True)
            print(f"load average after run {i}: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
