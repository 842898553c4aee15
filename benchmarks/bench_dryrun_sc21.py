"""The planner's memory model against ``paratron dryrun`` for the ten rows of Megatron SC21 table 1.

Each row (``paratron/planner/data/megatron-sc21-table1.csv``: GPT, LayerNorm, learned positions,
GELU, biases, tied embeddings, s = 2048, V = 51,200) at the paper's TP x PP and GPU count, bf16,
micro-batch 1, full activation recomputation off, 1F1B, ZeRO off; the global batch is cut to
``dp x pp`` sequences (``pp`` microbatches per pipeline: 1F1B's peak in flight is reached at
``m >= pp``), so that each rank's step stays short. The first and the last rank are rehearsed (the
embedding's and the head's stage). Prints a Markdown table: model-state bytes (params + grads +
optimizer) and peak (model states + activations) of the dry run, the planner's, and the ratios.

    .venv/bin/python benchmarks/bench_dryrun_sc21.py [--rows 0,1,...] [--plans paper|best]

With ``--plans best`` each row is first planned (``paratron plan``'s search: A100 80 GB, 8 per
node, the row's GPU count and global batch) and the planner's top plan is rehearsed instead of
the paper's layout, its batch cut as ``paratron plan --verify`` cuts it.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from paratron.rules import build_config, validate
import dataclasses

from paratron.dryrun.run import dry_run
from paratron.dryrun.verify import plan_config
from paratron.planner.estimate import Problem
from paratron.planner.hardware import Cluster, device
from paratron.planner.search import plan
from paratron.planner.shape import Shape

TABLE = Path(__file__).resolve().parents[1] / "paratron" / "planner" / "data" / "megatron-sc21-table1.csv"
GPT = ["model.normalization=layernorm", "model.position_embedding_type=learned", "model.activation=gelu",
       "model.add_bias_linear=true", "model.tie_embeddings=true", "model.vocab_size=51200", "model.seq_length=2048",
       "train.precision=bf16", "train.micro_batch_size=1", "parallel.hang_timeout_s=0"]


def rows() -> list[dict]:
    with TABLE.open() as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def row_config(r: dict):
    tp, pp, world = int(r["tensor_parallel"]), int(r["pipeline_parallel"]), int(r["num_gpus"])
    dp = world // (tp * pp)
    cfg = build_config(None, GPT + [f"model.num_layers={r['num_layers']}", f"model.hidden_size={r['hidden_size']}",
                                    f"model.num_attention_heads={r['attention_heads']}",
                                    f"parallel.tensor={tp}", f"parallel.pipeline={pp}",
                                    f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
                                    f"train.global_batch_size={dp * pp}"])
    validate(cfg, world)
    return cfg, world


def best_plan_config(r: dict, cfg, world: int):
    """The planner's top plan for row ``r`` (its model, GPU count and global batch) as a config
    with the batch cut like ``plan --verify``; and the plan's one-line name."""
    model = dataclasses.replace(cfg.model)
    prob = Problem(model, Shape.of(model, model.seq_length), Cluster(world // 8, 8, device("a100", memory_gb=80)),
                   int(r["global_batch_size"]), model.seq_length)
    est = plan(prob, cfg, 1, quiet=True).plans[0]
    return plan_config(cfg, est, prob), est.layout.short()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    ap.add_argument("--plans", choices=("paper", "best"), default="paper",
                    help="rehearse the paper's TP x PP (default) or the planner's top plan")
    args = ap.parse_args()
    table = rows()
    chosen = range(len(table)) if args.rows is None else [int(i) for i in args.rows.split(",")]
    print("| params (B) | layout | rank | states dry (GB) | states planner (GB) | ratio "
          "| peak dry (GB) | peak planner (GB) | ratio | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i in chosen:
        r = table[i]
        cfg, world = row_config(r)
        p = cfg.parallel
        name = f"{p.tensor} x {p.pipeline} x {world // (p.tensor * p.pipeline)}"
        if args.plans == "best":
            cfg, name = best_plan_config(r, cfg, world)
        t0 = time.perf_counter()
        rep = dry_run(cfg, world, sorted({0, world - 1}), quiet=True)
        secs = (time.perf_counter() - t0) / len(rep.ranks)
        for row in rep.ranks:
            v = {term: (dry, want) for term, dry, want, _ in row["vs_planner"]}
            sd = sum(v[t][0] for t in ("params", "grads", "optimizer"))
            sp = sum(v[t][1] for t in ("params", "grads", "optimizer"))
            pd, pk = sd + v["activations"][0], sp + v["activations"][1]
            print(f"| {r['params_billion']} | {name} | {row['rank']} "
                  f"| {sd / 1e9:.2f} | {sp / 1e9:.2f} | {sd / sp:.3f} | {pd / 1e9:.2f} | {pk / 1e9:.2f} "
                  f"| {pd / pk:.3f} | {secs:.0f} |", flush=True)


if __name__ == "__main__":
    main()
