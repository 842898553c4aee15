"""FP8 against bf16: one column-parallel linear's forward+backward, side by side.

    .venv/bin/python benchmarks/bench_fp8.py [--tokens 2048 --hidden 1024 --out-features 4096
                                             --iters 20 --device cpu --scaling tensorwise]
    .venv/bin/python benchmarks/bench_fp8.py --convergence [--steps 200]

Both sides are paratron's :class:`ColumnParallelLinear` at TP=1 with bf16 params and inputs; the
FP8 side has ``fp8`` set (three ``torch._scaled_mm`` calls, e4m3 x e4m3 forward, e5m2 grads); a
third, fp32 side is the CPU's fast path for reference. Iterations alternate the sides and the
script prints the median time of each and the ratios FP8 / bf16 and FP8 / fp32 (lower is
better), with the load average. A CPU has no FP8 arithmetic: ``_scaled_mm`` there is a slow
emulating kernel, and whatever the ratio to bf16 (whose CPU GEMM is slow too), CPU FP8 is not
where the gain lives: that is on GPUs with FP8 tensor cores (``scripts/gpu_check.sh`` runs this with ``--device cuda``).

``--convergence``: ``paratron train`` on the bundled corpus (configs/gpt2-tiny.toml, one process,
bf16) for ``--steps`` steps, once without and once with ``train.fp8``, and prints both final
validation losses (8 validation batches after the last step) and their relative difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

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


def final_val_loss(steps: int, extra: list[str]) -> float:
    """Train configs/gpt2-tiny.toml in bf16 for ``steps`` steps; the last validation loss."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "paratron", "train", "--config", str(ROOT / "configs/gpt2-tiny.toml"),
               "--run-dir", d, "--set", f"train.train_iters={steps}", "--set", "train.eval_interval=0",
               "--set", "train.eval_iters=8", "--set", "train.precision=bf16", "--set", "checkpoint.save=none",
               "--set", "train.sample_prompt=none", "--set", "logging.tensorboard=false"]
        for e in extra:
            cmd += ["--set", e]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
        recs = [json.loads(line) for line in Path(d, "metrics.jsonl").read_text().splitlines()]
        return [r["val_loss"] for r in recs if "val_loss" in r][-1]


def convergence(steps: int, scaling: str, fmt: str) -> None:
    bf16 = final_val_loss(steps, [])
    fp8 = final_val_loss(steps, [f"train.fp8={scaling}", f"train.fp8_format={fmt}"])
    print(f"{steps} steps, configs/gpt2-tiny.toml, bf16: final validation loss bf16 {bf16:.4f}, "
          f"fp8 ({scaling}, {fmt}) {fp8:.4f}, relative difference {(fp8 - bf16) / bf16:+.2%} "
          f"(load_avg={os.getloadavg()[0]:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out-features", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--scaling", default="tensorwise", choices=["tensorwise", "rowwise"])
    ap.add_argument("--format", default="hybrid", choices=["hybrid", "e4m3"])
    ap.add_argument("--convergence", action="store_true", help="the 200-step run against bf16")
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    if a.convergence:
        return convergence(a.steps, a.scaling, a.format)
    dev = torch.device(a.device)
    ctx = ParallelContext.single(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp32": torch.float32}
    layers = {}
    for name, dt in dtypes.items():
        layer = ColumnParallelLinear(a.hidden, a.out_features, ctx, logical_name="fc", seed=0, bias=False,
                                     params_dtype=dt).to(dev)
        if name == "fp8":
            layer.fp8 = Fp8Recipe(a.scaling, E5M2 if a.format == "hybrid" else E4M3)
        layers[name] = layer
    g = torch.Generator().manual_seed(0)
    x32 = torch.randn(a.tokens, 1, a.hidden, generator=g)
    dy32 = torch.randn(a.tokens, 1, a.out_features, generator=g)
    inputs = {name: (x32.to(dev, dt).requires_grad_(), dy32.to(dev, dt)) for name, dt in dtypes.items()}
    times = {name: [] for name in dtypes}
    for i in range(a.iters + 2):
        order = list(dtypes) if i % 2 == 0 else list(reversed(dtypes))
        for name in order:
            x, dy = inputs[name]
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
    print(f"fp32 forward+backward: {med['fp32'] * 1e3:.2f} ms (median)")
    print(f"ratio fp8 / bf16: median {med['fp8'] / med['bf16']:.2f}, paired {paired:.2f}; "
          f"fp8 / fp32: median {med['fp8'] / med['fp32']:.2f}")


if __name__ == "__main__":
    main()
