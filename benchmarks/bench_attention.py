"""Causal attention under ``torch.compile`` on the CPU: torch's flash kernel against paratron's
blocked composite form (``paratron.models.attention.blocked_causal_attention``).

Both are compiled the way ``model.compile`` compiles a layer (inductor, C++ wrapper) and run
forward and backward on the same ``[s, b, n, d]`` inputs, timed in turn with
``pairing.time_paired`` (CPU time of this thread; >= 30 timed steps, order reversed every other
step). Shapes: the main job's attention (s=128, b=4, 8 query heads, 4 KV groups, d=32), then
longer sequences up to s=1024. Reported per shape: the median ms of each, the paired ratio
blocked / flash with its spread, and the bytes each saves for its backward (counted with
``torch.autograd.graph.saved_tensors_hooks`` on one extra call).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_attention.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from pairing import MIN_TIMED_STEPS, load, paired_ratio, time_paired  # noqa: E402
from paratron.models.attention import blocked_causal_attention  # noqa: E402
from paratron.models.gpt import inductor_options  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402

# (s, b, query heads, KV groups, head dim)
SHAPES = [(128, 4, 8, 4, 32), (256, 2, 8, 4, 64), (512, 1, 8, 4, 64), (1024, 1, 16, 4, 128)]


def flash(q, k, v):
    """torch's causal SDPA (the CPU flash kernel) in the model's ``[s, b, n, d]`` layout."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         enable_gqa=k.shape[2] != q.shape[2])
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def saved_bytes(fn, inputs, grad) -> int:
    """Bytes of the tensors one forward of ``fn`` saves for its backward."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    out.backward(grad)
    return sum(total)


def one_shape(shape, steps: int) -> dict:
    s, b, n, g, d = shape
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, b, heads, d, generator=gen, requires_grad=True) for heads in (n, g, g)]
    grad = torch.randn(s, b, n * d, generator=gen)
    options = inductor_options(ParallelContext.single())
    fns = {"flash": torch.compile(flash, options=options),
           "blocked": torch.compile(blocked_causal_attention, options=options)}
    cpu = {name: [] for name in fns}

    def run(name, step):
        c0 = time.thread_time()
        fns[name](*inputs).backward(grad)
        if step >= 3:
            cpu[name].append(time.thread_time() - c0)

    time_paired(list(fns), steps, run, sync=lambda: None, reduce=lambda t: t)
    return {"shape": dict(zip(("s", "b", "heads", "groups", "d"), shape)),
            "cpu_median_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in cpu.items()},
            "paired_blocked_vs_flash": paired_ratio(cpu["blocked"], cpu["flash"]),
            "saved_bytes": {k: saved_bytes(f, inputs, grad) for k, f in fns.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=MIN_TIMED_STEPS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    before = load()
    rows = [one_shape(shape, args.steps) for shape in SHAPES]
    print(json.dumps({"load_before": before, "load_after": load(), "steps": args.steps, "shapes": rows}, indent=1))


if __name__ == "__main__":
    main()
