"""Initialisation time of one rank's shard at TP=8: paratron's per-shard tile
draw (``layers/init.init_shard_``, what ``build_model_chunks`` runs) against the previous scheme,
which drew every parameter's full tensor from one ``(seed, name)`` generator and kept a slice.

The model is a ~1.3B-parameter GPT (24 layers, h=2048, 16 heads, ffn 8192, vocab 50304, SwiGLU
off). One process plays TP rank 0 of 8 (initialisation reads only the TP size and rank, so no
process group is needed). Both sides fill the same parameter tensors; iterations alternate.

Usage: .venv/bin/python benchmarks/bench_init.py [--tp 8 --layers 24 --iters 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from paratron.config import ModelConfig  # noqa: E402
from paratron.layers.init import generator_for  # noqa: E402
from paratron.models.gpt import build_model_chunks  # noqa: E402
from paratron.parallel.comm import Group  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.parallel.params import unique_params  # noqa: E402


def rank_view(tp: int) -> ParallelContext:
    ctx = ParallelContext.single()
    return dataclasses.replace(ctx, tp=Group("tp", list(range(tp)), 0, None, ctx.ledger))


def full_draw_(params, seed: int, std: float) -> None:
    """The previous scheme: the whole tensor from one generator, then this rank's slice."""
    with torch.no_grad():
        for p in params:
            if p.dim() < 2:
                continue
            full = torch.empty(p.meta.shard.global_shape).normal_(0.0, std, generator=generator_for(seed, p.meta.logical_name))
            p.meta.shard.valid(p).copy_(full[p.meta.shard.slices()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    cfg = ModelConfig(num_layers=a.layers, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192,
                      vocab_size=50304, seq_length=2048, tie_embeddings=False)
    ctx = rank_view(a.tp)
    shard_s, full_s = [], []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        chunks = build_model_chunks(cfg, ctx, seed=1)
        shard_s.append(time.perf_counter() - t0)
        params = unique_params(chunks)
        t0 = time.perf_counter()
        full_draw_(params, 1, cfg.init_method_std)
        full_s.append(time.perf_counter() - t0)
    total = sum(math.prod(p.meta.shard.global_shape) for p in params)
    own = sum(p.numel() for p in params)
    print(f"model {total / 1e9:.2f}B params, rank's own {own / 1e6:.0f}M at tp={a.tp}")
    print(f"shard draw (build incl.): median {statistics.median(shard_s):.2f}s  runs {[round(x, 2) for x in shard_s]}")
    print(f"full draw + slice:        median {statistics.median(full_s):.2f}s  runs {[round(x, 2) for x in full_s]}")
    print(f"ratio shard / full: {statistics.median(shard_s) / statistics.median(full_s):.3f}")


if __name__ == "__main__":
    main()
