"""What the parallel machinery costs on CPU, for the main job's model.

1. Tokens/s of the default config (4 ranks: TP=2 x PP=2, sequence parallel, 1F1B) against the same
   model at layout (1) on one process, both through ``paratron train`` on the bundled corpus
   (median tokens/s of steps 3.. from ``metrics.jsonl``). On 2 cores, 4 ranks share 2 cores, so this
   shows overhead, not speed-up.
2. Overhead of paratron's whole training step at layout (1) (data -> pipeline runtime -> DDP ->
   AdamW) against a plain PyTorch loop (the reference model of ``bench_model.py``, same weights,
   ``torch.optim.AdamW``), same shapes, fp32, one process, interleaved rounds.

    .venv/bin/python benchmarks/bench_train.py [--iters 12] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def cli_tokens_per_second(extra: list[str], nproc: int, iters: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        # This interpreter, run from the repository root: the checkout being measured, venv or not.
        cmd = [sys.executable, "-m", "paratron", "train", "--config", str(ROOT / "configs/default.toml"),
               "--run-dir", d, "--set", f"train.train_iters={iters}", "--set", "train.eval_interval=0",
               "--set", "checkpoint.save=none", "--set", "train.sample_prompt=none",
               "--set", "optimizer.lr_warmup_iters=1", "--set", "logging.tensorboard=false"]
        for e in extra:
            cmd += ["--set", e]
        if nproc > 1:
            cmd += ["--nproc-per-node", str(nproc)]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
        recs = [json.loads(l) for l in Path(d, "metrics.jsonl").read_text().splitlines()]
        return statistics.median(r["tokens_per_second"] for r in recs if "loss" in r and r["iteration"] >= 3)


def step_overhead(rounds: int, steps: int) -> dict:
    from bench_model import RefModel

    from paratron.rules import load_config
    from paratron.models.gpt import gather_full_state
    from paratron.config.model_shape import ffn_size, query_groups
    from paratron.parallel.context import ParallelContext
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.trainer import train_batch

    cfg = load_config(ROOT / "configs/default.toml", ["parallel.tensor=1", "parallel.pipeline=1",
                                                       "parallel.sequence_parallel=false", "model.vocab_size=8192",
                                                       "model.tie_embeddings=false"])
    ctx = ParallelContext.single()
    torch.manual_seed(0)
    chunks, ddp, opt, sched = build_model_and_optimizer(cfg, ctx)
    ref_cfg = dataclasses.replace(cfg.model, ffn_hidden_size=ffn_size(cfg.model),
                                  num_query_groups=query_groups(cfg.model))
    ref = RefModel(ref_cfg)
    ref.load(gather_full_state(chunks, ctx))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.optimizer.lr, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    m, b, s = cfg.train.global_batch_size // cfg.train.micro_batch_size, cfg.train.micro_batch_size, cfg.model.seq_length
    mbs = [{"tokens": torch.randint(0, 8192, (b, s), generator=g), "labels": torch.randint(0, 8192, (b, s), generator=g)}
           for _ in range(m)]

    def paratron_step():  # the training loop's whole step (zero grads, schedule, finalize, update, LR)
        train_batch(cfg, ctx, chunks, ddp, opt, sched, mbs)

    def ref_step():
        ref_opt.zero_grad()
        n = sum(mb["labels"].numel() for mb in mbs)
        for mb in mbs:
            (ref(mb["tokens"], mb["labels"]).sum() / n).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.optimizer.clip_grad)
        ref_opt.step()

    paratron_step(), ref_step()  # warm-up
    ratios, times = [], {"paratron": [], "reference": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            paratron_step()
        t1 = time.perf_counter()
        for _ in range(steps):
            ref_step()
        t2 = time.perf_counter()
        times["paratron"].append((t1 - t0) / steps)
        times["reference"].append((t2 - t1) / steps)
        ratios.append((t1 - t0) / (t2 - t1))
    return {"paratron_s": statistics.median(times["paratron"]), "reference_s": statistics.median(times["reference"]),
            "ratio_median": statistics.median(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    over = step_overhead(args.rounds, args.steps)
    print(f"layout (1) training step: paratron {over['paratron_s']:.3f} s, plain PyTorch {over['reference_s']:.3f} s, "
          f"ratio {over['ratio_median']:.3f}")
    single = cli_tokens_per_second(["parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false"],
                                   1, args.iters)
    default = cli_tokens_per_second([], 4, args.iters)
    print(f"tokens/s: default layout (4 ranks, tp2 x pp2, SP) {default:.0f}, layout (1) one process {single:.0f}, "
          f"ratio {default / single:.3f}")


if __name__ == "__main__":
    main()
