"""FP8 against bf16: one column-parallel linear's forward+backward, side by side.

    .venv/bin/python benchmarks/bench_fp8.py [--tokens 2048 --hidden 1024 --out-features 4096
                                             --iters 20 --device cpu --scaling tensorwise]

Both sides are paratron's :class:`ColumnParallelLinear` at TP=1 with bf16 params and inputs; the
FP8 side has ``fp8`` set (three ``torch._scaled_mm`` calls, e4m3 x e4m3 forward, e5m2 grads).
Iterations alternate the two and the script prints the median time of each and the ratio
FP8 / bf16 (lower is better), with the load average. On CPU ``_scaled_mm`` upcasts and runs an
fp32 GEMM, and the casts are extra passes, so CPU FP8 is slower: the gain lives on GPUs with FP8
tensor cores (``scripts/gpu_check.sh`` runs this with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paratron.layers.fp8 import E4M3, E5M2, Fp8Recipe  # noqa: E402
from paratron.layers.linear import ColumnParallelLinear  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402


def _step(layer, x, dy, sync) -> float:
    t0 = time.perf_counter()
    y = layer(x)
    y.backward(dy)
    sync()
    layer.weight.grad = None
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out-features", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scaling", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--format", default="hybrid", choices=["hybrid", "e4m3"])
    a = ap.parse_args()
    dev = torch.device(a.device)
    ctx = ParallelContext.single(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    layers = {}
    for name in ("bf16", "fp8"):
        layer = ColumnParallelLinear(a.hidden, a.out_features, ctx, logical_name="fc", seed=0, bias=False,
                                     params_dtype=torch.bfloat16).to(dev)
        if name == "fp8":
            layer.fp8 = Fp8Recipe(a.scaling, E5M2 if a.format == "hybrid" else E4M3)
        layers[name] = layer
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.tokens, 1, a.hidden, generator=g).to(dev, torch.bfloat16).requires_grad_()
    dy = torch.randn(a.tokens, 1, a.out_features, generator=g).to(dev, torch.bfloat16)
    times = {"bf16": [], "fp8": []}
    for i in range(a.iters + 2):
        for name in ("bf16", "fp8") if i % 2 == 0 else ("fp8", "bf16"):
            t = _step(layers[name], x, dy, sync)
            x.grad = None
            if i >= 2:  # two warm-up rounds
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = statistics.median(f / b for f, b in zip(times["fp8"], times["bf16"]))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"device={dev} tokens={a.tokens} in={a.hidden} out={a.out_features} scaling={a.scaling} "
          f"format={a.format} iters={a.iters} load_avg={load:.1f}")
    print(f"bf16 forward+backward: {med['bf16'] * 1e3:.2f} ms (median)")
    print(f"fp8  forward+backward: {med['fp8'] * 1e3:.2f} ms (median)")
    print(f"ratio fp8 / bf16: median {med['fp8'] / med['bf16']:.2f}, paired {paired:.2f}")


if __name__ == "__main__":
    main()
