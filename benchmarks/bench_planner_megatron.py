"""Planner against Narayanan et al. 2021 (Megatron-LM, SC21), table 1: GPT models from 1.7 B to
1 T parameters on A100-80GB (paratron/planner/data/megatron-sc21-table1.csv).

For each published row:

1. the planner's prediction for the *published* layout (its tp, pp, dp and batch; the paper's
   settings otherwise: microbatch 1, 1F1B, full activation recompute, no sequence parallelism,
   no ZeRO, fp16/bf16, dropout 0.1, unfused attention, sequence 2048, vocabulary 51,200), as
   TFLOP/s per GPU counted with the paper's formula (its equation 3, recompute included, which is
   ``paratron.models.flops.flops_per_token(include_recompute=True)`` under full recompute);
2. the planner's own best plan on the same cluster and batch (any layout the validator accepts,
   the same unfused attention), its predicted throughput and memory per GPU.

Usage: PYTHONPATH=. python benchmarks/bench_planner_megatron.py [--rows 0,1,...]
Prints a markdown table (recorded in benchmarks/README.md) and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

from paratron.config import Config, ModelConfig
from paratron.planner.estimate import Estimate, Problem, estimate
from paratron.planner.hardware import Cluster, device
from paratron.planner.layout import Layout
from paratron.planner.pipeline import ScheduleCache
from paratron.planner.search import plan
from paratron.planner.shape import Shape

TABLE = Path(__file__).resolve().parent.parent / "paratron" / "planner" / "data" / "megatron-sc21-table1.csv"
SEQ, VOCAB = 2048, 51200


def rows() -> list[dict]:
    with open(TABLE) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def gpt_model(row: dict) -> ModelConfig:
    """The paper's GPT: LayerNorm, learned positions, GELU, biases, tied embeddings, dropout 0.1."""
    return ModelConfig(num_layers=int(row["num_layers"]), hidden_size=int(row["hidden_size"]),
                       num_attention_heads=int(row["attention_heads"]), vocab_size=VOCAB, seq_length=SEQ,
                       make_vocab_size_divisible_by=128, hidden_dropout=0.1, attention_dropout=0.1)


def problem(row: dict) -> tuple[Problem, Config]:
    model = gpt_model(row)
    gpus = int(row["num_gpus"])
    cluster = Cluster(gpus // 8, 8, device("a100"))
    base = Config(model=model)
    return Problem(model, Shape.of(model, SEQ), cluster, int(row["global_batch_size"]), SEQ,
                   fused_attention=False), base


def published_layout(row: dict) -> Layout:
    tp, pp, gpus = int(row["tensor_parallel"]), int(row["pipeline_parallel"]), int(row["num_gpus"])
    return Layout(tp, pp, 1, gpus // (tp * pp), 1, 1, 0, "1f1b", 1, "full", False)


def published_row(row: dict, cache: ScheduleCache) -> tuple[Estimate, float, bool]:
    """(prediction for the published layout, its error against the paper, its checks pass)."""
    prob, _ = problem(row)
    pub = estimate(prob, published_layout(row), cache)
    err = pub.hw_tflops_per_device / float(row["achieved_tflops_per_gpu"]) - 1
    return pub, err, abs(err) <= 0.25 and pub.memory.total <= prob.cluster.hw.memory_bytes


def best_row(row: dict, cache: ScheduleCache) -> tuple[Estimate, float]:
    """(the planner's best plan, seconds its search took)."""
    prob, base = problem(row)
    t0 = time.time()
    best = plan(prob, base, top_k=1, cache=cache).plans[0]
    return best, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    ap.add_argument("--no-search", action="store_true", help="only the published layouts (fast)")
    args = ap.parse_args()
    table = rows()
    picked = [int(i) for i in args.rows.split(",")] if args.rows else list(range(len(table)))
    cache, ok = ScheduleCache(), True
    print("| params (B) | GPUs | batch | published tp/pp/dp | published TFLOP/s/GPU | predicted, published layout "
          "(error) | its bubble | its memory GB | planner's best plan | best / published tokens/s "
          "| best's memory GB | search s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i in picked:
        row = table[i]
        pub, err, passed = published_row(row, cache)
        lay, ok = pub.layout, ok and passed
        cells = [row["params_billion"], row["num_gpus"], row["global_batch_size"], f"{lay.tp}/{lay.pp}/{lay.dp}",
                 f"{float(row['achieved_tflops_per_gpu']):.0f}", f"{pub.hw_tflops_per_device:.1f} ({err:+.1%})",
                 f"{pub.bubble:.3f}", f"{pub.memory.total / 1e9:.1f}"]
        if args.no_search:
            cells += ["", "", "", ""]
        else:
            best, seconds = best_row(row, cache)
            gain = best.tokens_per_second / pub.tokens_per_second
            ok &= gain >= 1.0 - 1e-9 and best.memory.total <= 80e9
            cells += [best.layout.short(), f"{gain:.3f}x", f"{best.memory.total / 1e9:.2f}", f"{seconds:.0f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |", flush=True)
    print("all checks pass" if ok else "SOME CHECK FAILS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
