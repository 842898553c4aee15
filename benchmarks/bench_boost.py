"""BOOST's headline at TP=2 as far as a CPU allows: the TP bytes and the step time of a low-rank
(CoLA) model under the bottleneck plan against the naive plan and against the full-rank model
(BOOST, MLSys'26; CoLA, Liu et al. 2025; docs/boost.md).

Every variant is the same Llama-style model (RMSNorm, RoPE, SwiGLU, no biases) of ``--layers``
layers of width ``--hidden``; the low-rank ones have r = hidden / 4 (``--rank``). One model chunk
per variant (embedding, layers, loss) on two gloo ranks, one thread each (``paratron.local_ranks.
run_ranks``). A step is one forward+backward of ``--batch`` x ``--seq`` tokens. Bytes are the comm
ledger's TP payloads (its own convention: all-reduce the tensor, all-gather the local shard),
recorded over one step. Timed steps alternate the variants (their order rotating each round) so
that load from other processes hits all alike; printed: the median step time and the median of
per-round ratios against naive and full rank. The load average is printed before and after.

Usage: .venv/bin/python benchmarks/bench_boost.py [--layers 4 --hidden 256 --seq 128 --batch 2 --rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from paratron.config import ModelConfig  # noqa: E402
from paratron.models.gpt import build_model_chunks  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

VARIANTS = {"full": dict(low_rank=0), "naive": dict(low_rank_tp="naive"),
            "bottleneck": dict(low_rank_tp="bottleneck"),
            "bottleneck+recompute": dict(low_rank_tp="bottleneck", low_rank_recompute=True)}


def _model(args, **kw) -> ModelConfig:
    base = dict(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                ffn_hidden_size=4 * args.hidden, vocab_size=512, seq_length=args.seq, normalization="rmsnorm",
                position_embedding_type="rope", activation="swiglu", add_bias_linear=False,
                low_rank=args.rank or args.hidden // 4)
    return ModelConfig(**{**base, **kw})


def _step(chunk, x) -> None:
    chunk(x, x).sum().backward()
    chunk.zero_grad(set_to_none=True)


def _rank(args) -> dict:
    ctx = ParallelContext.build(tp=2)
    chunks = {n: build_model_chunks(_model(args, **kw), ctx, seed=1)[0] for n, kw in VARIANTS.items()}
    x = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    out = {n: {"bytes": 0, "ms": []} for n in chunks}
    for n, c in chunks.items():
        _step(c, x)  # warm-up
        with ctx.ledger.recording():
            _step(c, x)
            out[n]["bytes"] = ctx.ledger.total(group="tp").bytes
    names = list(chunks)
    for i in range(args.rounds):
        for n in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            _step(chunks[n], x)
            out[n]["ms"].append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0, help="r (default hidden / 4)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    res = run_ranks(_rank, 2, args, timeout=1800)[0]
    load1 = os.getloadavg()[0]
    print(f"TP=2, {args.layers} layers, h={args.hidden}, r={args.rank or args.hidden // 4}, "
          f"{args.batch}x{args.seq} tokens, {args.rounds} rounds; load average {load0:.1f} -> {load1:.1f}")
    print("| variant | TP bytes / step | bytes / naive | bytes / full | step ms (median) | step / naive | step / full |")
    print("|---|---|---|---|---|---|---|")
    for n, r in res.items():
        ratio = {ref: statistics.median(a / b for a, b in zip(r["ms"], res[ref]["ms"])) for ref in ("naive", "full")}
        print(f"| {n} | {r['bytes']:,} | {r['bytes'] / res['naive']['bytes']:.3f} | "
              f"{r['bytes'] / res['full']['bytes']:.3f} | {statistics.median(r['ms']):.1f} | "
              f"{ratio['naive']:.2f} | {ratio['full']:.2f} |")


if __name__ == "__main__":
    main()
