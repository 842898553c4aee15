"""Muon against AdamW on the main job's model.

1. Loss: the default config's model (``configs/default.toml``) trained for ``--iters`` steps
   (200) at layout (1) on one process through ``paratron train`` on the bundled corpus, once with
   ``optimizer.name = "adamw"`` and once with ``"muon"`` (same lr schedule, weight decay, batches
   and so tokens; Muon's default ``spectral`` scale times 0.2 lets AdamW's lr carry over). Reports
   the last logged training loss and the validation loss at the end (``metrics.jsonl``).
2. Optimizer step time: ``Optimizer.step()`` of the same model at one process with random grads,
   AdamW and Muon alternating for ``--rounds`` rounds; median milliseconds and the ratio.

    .venv/bin/python benchmarks/bench_muon.py [--iters 200] [--rounds 20]

Run directories and the tokenised corpus go to a temporary directory (outside the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def train_losses(name: str, iters: int, tmp: str) -> dict:
    run = Path(tmp, name)
    cmd = [sys.executable, "-m", "paratron", "train", "--config", str(ROOT / "configs/default.toml"),
           "--run-dir", str(run)]
    for s in (f"optimizer.name={name}", f"train.train_iters={iters}", f"train.eval_interval={iters}",
              "parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false",
              "checkpoint.save=none", "train.sample_prompt=none", "logging.tensorboard=false",
              f"data.cache_dir={Path(tmp, 'cache')}"):
        cmd += ["--set", s]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    val = [r for r in recs if "val_loss" in r or "validation_loss" in r]
    return {"train_loss": train[-1]["loss"], "train_iter": train[-1]["iteration"],
            "val_loss": (val[-1].get("val_loss", val[-1].get("validation_loss")) if val else None),
            "wall_s": time.perf_counter() - t0}


def step_times(rounds: int) -> dict:
    from paratron.config import OptimizerConfig
    from paratron.rules import load_config
    from paratron.models.gpt import build_model_chunks
    from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads
    from paratron.parallel.context import ParallelContext

    cfg = load_config(ROOT / "configs/default.toml", ["model.vocab_size=8192"])
    ctx = ParallelContext.single()
    opts = {}
    for name in ("adamw", "muon"):
        chunks = build_model_chunks(cfg.model, ctx, seed=1)
        ddp = DistributedDataParallel(chunks, ctx)
        opts[name] = (chunks, ddp, build_optimizer(chunks, ctx, OptimizerConfig(name=name, lr=1e-3), ddp))
    g = torch.Generator().manual_seed(0)
    ms = {name: [] for name in opts}
    for _ in range(rounds):
        for name, (chunks, ddp, opt) in opts.items():
            opt.zero_grad()
            for buf in ddp.buffers:
                buf.grad_data.copy_(torch.randn(buf.grad_data.shape, generator=g) * 1e-3)
            finalize_grads(chunks, ctx, ddp)
            t0 = time.perf_counter()
            opt.step()
            ms[name].append(1e3 * (time.perf_counter() - t0))
    params = sum(p.numel() for p in opts["adamw"][0][0].parameters())
    med = {name: statistics.median(v) for name, v in ms.items()}
    return {"params": params, "median_ms": med, "muon_over_adamw": med["muon"] / med["adamw"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()}")
    print(json.dumps(step_times(args.rounds), indent=1))
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("adamw", "muon"):
            print(name, json.dumps(train_losses(name, args.iters, tmp)), flush=True)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
