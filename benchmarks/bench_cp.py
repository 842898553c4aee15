"""Context parallelism at s=2048 on 2 ranks: step time and peak memory per rank, CP=2 (ring and
all2all) against CP=1 (the same 2 ranks as DP=2), and torch's own context parallelism.

Usage::

    .venv/bin/python benchmarks/bench_cp.py [--steps 4] [--seq 2048]

Model: Llama-style, 2 layers, h=128, 8 heads / 4 KV groups, SwiGLU 352, vocab 512, fp32, AdamW.
Global batch 2 sequences of ``--seq`` tokens, microbatches of 1 sequence, so every layout gives each
rank the same number of tokens per step:

* ``cp1-dp2``: each rank holds one whole sequence (SDPA attention);
* ``cp2-ring`` / ``cp2-all2all``: each rank holds half of both sequences.

All three layouts live in the same forked pair of gloo ranks (one thread each; CP=1 is the DP=2
layout of the same world) and train through the real stack (``build_model_and_optimizer``, the
data loader's CP split, ``run_global_batch``, the optimizer step), taking their steps in turn so
that machine load hits them alike. Step time: median over ``--steps`` after one warm-up, the
slower rank's. Peak memory: the
largest live CPU bytes of one step seen by the profiler (op granularity) on each rank, minus the
bytes live before it. The losses of the layouts are printed side by side (they must agree).

``torch.distributed.tensor.experimental.context_parallel`` is tried on the same 2 ranks with plain
causal SDPA; on CPU it fails (no sharding strategy for ``_scaled_dot_product_flash_attention_for_cpu``
in torch 2.13), which the script reports instead of a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from paratron.config import Config
from paratron.rules import validate  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402


def _config(seq: int, cp: int, algorithm: str) -> Config:
    cfg = Config()
    m, p, t = cfg.model, cfg.parallel, cfg.train
    m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size = 2, 128, 8, 4, 352
    m.vocab_size, m.seq_length, m.normalization, m.position_embedding_type = 512, seq, "rmsnorm", "rope"
    m.activation, m.add_bias_linear, m.tie_embeddings = "swiglu", False, False
    p.context, p.context_algorithm = cp, algorithm
    t.micro_batch_size, t.global_batch_size = 1, 2
    return validate(cfg, 2)


def _peak_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


LAYOUTS = (("cp1-dp2", 1, "ring"), ("cp2-ring", 2, "ring"), ("cp2-all2all", 2, "all2all"))


def _layout_step(seq: int, cp: int, algorithm: str):
    """One layout's model, optimizer and microbatches on this rank: a function running one step."""
    from paratron.training.data_iter import microbatch_preparer
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    cfg = _config(seq, cp, algorithm)
    ctx = ParallelContext.build(cp=cp)
    torch.manual_seed(0)
    chunks, ddp, opt, _ = build_model_and_optimizer(cfg, ctx)
    prepare = microbatch_preparer(cfg, ctx, eod=0)
    tokens = torch.randint(0, 512, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    rows = range(2) if ctx.dp.size == 1 else [ctx.dp.rank]
    micro = [prepare({"tokens": tokens[i:i + 1, :-1], "labels": tokens[i:i + 1, 1:]}) for i in rows]

    def step():
        opt.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, micro, forward_only=False, ddp=ddp)
        opt.step()
        return out.loss

    return ctx, step


def _rank(seq: int, steps: int) -> dict:
    """Every layout on the same 2 ranks, steps taken in turn (machine load hits them alike)."""
    runs = {name: _layout_step(seq, cp, algorithm) for name, cp, algorithm in LAYOUTS}
    out = {name: {"losses": [step()], "times": []} for name, (_, step) in runs.items()}
    for _ in range(steps):
        for name, (ctx, step) in runs.items():
            ctx.world.barrier()
            t0 = time.perf_counter()
            out[name]["losses"].append(step())
            out[name]["times"].append(time.perf_counter() - t0)
    for name, (_, step) in runs.items():
        out[name]["peak"] = _peak_bytes(step)
    return out


def _torch_cp(seq: int) -> str:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (2,))
    q, k, v = (torch.randn(1, 8, seq, 16) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return f"ran: {time.perf_counter() - t0:.3f} s"
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        cause = e.__context__ or e
        return f"does not run on CPU: {type(cause).__name__}: {str(cause).splitlines()[0]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    report = {"load_average_before": os.getloadavg()}
    res = run_ranks(_rank, 2, a.seq, a.steps, timeout=3000)
    base = None
    for name, _, _ in LAYOUTS:
        step = statistics.median(max(r[name]["times"][i] for r in res) for i in range(a.steps))
        peak = max(r[name]["peak"] for r in res) / 2**20
        row = {"step_s": round(step, 3), "peak_MiB_per_rank": round(peak, 1),
               "losses": [round(x, 5) for x in res[0][name]["losses"]]}
        if base is None:
            base = row
        else:
            row |= {"step_ratio_vs_cp1": round(step / base["step_s"], 3),
                    "peak_ratio_vs_cp1": round(peak / base["peak_MiB_per_rank"], 3)}
        report[name] = row
        print(name, json.dumps(row), flush=True)
    report["torch_context_parallel"] = run_ranks(_torch_cp, 2, a.seq, timeout=600)[0]
    report["load_average_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
