"""What the parallel machinery costs on CPU, for the main job's model.

1. Tokens/s of the default config (4 ranks: TP=2 x PP=2, sequence parallel, 1F1B) against the same
   model at layout (1) on one process, both through ``paratron train`` on the bundled corpus
   (median tokens/s of steps 3.. from ``metrics.jsonl``). On 2 cores, 4 ranks share 2 cores, so this
   shows overhead, not speed-up.
2. Overhead of paratron's whole training step at layout (1) (data -> pipeline runtime -> DDP ->
   AdamW) against a plain PyTorch loop (the reference model of ``bench_model.py``, same weights,
   ``torch.optim.AdamW``), same shapes, fp32, one process, interleaved rounds.

3. The GEMM share of that step (``--part gemm``): the step's matmuls at the model's own shapes
   (every linear's forward ``x W^T`` and its two backward products ``dY W`` and ``dY^T x``, the
   output layer's included, per layer and microbatch) timed alone with ``torch.mm`` on
   preallocated operands, over paratron's step time, eager and with ``model.compile = true``
   (each layer ``torch.compile``-d), measured in turn with ``pairing.time_paired``; the ratios
   in wall time and in this thread's CPU time (``time.thread_time``).

   The same loop also times, alone and at the model's shapes, the non-GEMM work that the step
   keeps however the rest is fused: the attention cores (``attention_core`` forward and backward,
   per layer and microbatch: torch's CPU flash kernel eagerly, the blocked composite form
   compiled, as each step runs them), the loss's softmax pass over the
   ``[tokens, V]`` logits buffer and the fused AdamW update. ``ceiling = GEMMs / (GEMMs + those
   three)`` is the largest GEMM share reachable while those three cost what they do;
   ``remainder`` is what a step spends beyond all four (norms, RoPE, SwiGLU, residuals,
   embedding, autograd, Python), CPU time, paired medians.

4. ``--part wrapper``: the compiled step with inductor's Python wrapper against the C++ wrapper
   ``model.compile`` uses in a one-process CPU run (two models in one process, paired,
   ``--gemm-steps`` steps).

   Every part runs with ``train.keep_host_memory``'s setting (glibc keeps freed heap memory for
   reuse), as ``paratron train`` does; ``--glibc-defaults`` leaves malloc's defaults.

    .venv/bin/python benchmarks/bench_train.py [--part all|overhead|gemm|wrapper] [--iters 12] [--rounds 5]
        [--glibc-defaults]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from pairing import MIN_TIMED_STEPS, load, paired_ratio, summarize, time_paired  # noqa: E402
from paratron.rules import load_config  # noqa: E402
from paratron.config.model_shape import ffn_size, head_dim, query_groups  # noqa: E402
from paratron.layers.cross_entropy import _local_softmax_stats_  # noqa: E402
from paratron.models.attention import attention_core  # noqa: E402
from paratron.models.gpt import inductor_options  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.training.builders import build_model_and_optimizer  # noqa: E402
from paratron.training.host_memory import keep_host_memory_if_cpu  # noqa: E402
from paratron.training.trainer import train_batch  # noqa: E402


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


LAYOUT_1 = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.sequence_parallel=false", "model.vocab_size=8192",
            "model.tie_embeddings=false"]


def linear_shapes(cfg) -> list[tuple[int, int]]:
    """``(in, out)`` of every linear of one microbatch's forward, the output layer last."""
    m = cfg.model
    h, d, n, g, f = m.hidden_size, head_dim(m), m.num_attention_heads, query_groups(m), ffn_size(m)
    up = 2 * f if m.activation == "swiglu" else f
    layer = [(h, (n + 2 * g) * d), (n * d, h), (h, up), (f, h)]
    return layer * m.num_layers + [(h, m.vocab_size)]


def gemm_operands(cfg) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(a, b, out)`` of the step's matmuls for one microbatch (three per linear, see the module
    docstring): fp32 operands and preallocated outputs, drawn once."""
    t_rows = cfg.train.micro_batch_size * cfg.model.seq_length
    ops = []
    for k, n in linear_shapes(cfg):
        x, w, dy = torch.randn(t_rows, k), torch.randn(n, k), torch.randn(t_rows, n)
        ops += [(x, w.t()), (dy, w), (dy.t(), x)]
    return [(a, b, torch.empty(a.shape[0], b.shape[1])) for a, b in ops]


def run_gemms(cfg, ops) -> None:
    """The step's matmuls alone: every microbatch's ``torch.mm`` calls into the preallocated outputs."""
    for _ in range(cfg.train.global_batch_size // cfg.train.micro_batch_size):
        for a, b, o in ops:
            torch.mm(a, b, out=o)


def floor_parts(cfg) -> dict:
    """The step's non-GEMM work that stays whatever else is fused (see the module docstring),
    each a callable doing one step's worth on operands drawn once."""
    m, t = cfg.model, cfg.train
    mbs = t.global_batch_size // t.micro_batch_size
    s, b, d, n, g = m.seq_length, t.micro_batch_size, head_dim(m), m.num_attention_heads, query_groups(m)
    q, k, v = (torch.randn(s, b, heads, d, requires_grad=True) for heads in (n, g, g))
    grad_out = torch.randn(s, b, n * d)
    logits, labels = torch.randn(b * s, m.vocab_size), torch.randint(0, m.vocab_size, (b * s,))
    params = [torch.randn(o, i) for i, o in linear_shapes(cfg)] + [torch.randn(m.vocab_size, m.hidden_size)]
    for p in params:
        p.grad = torch.randn_like(p)
    adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)

    # What each step runs: SDPA eagerly; under model.compile (CPU) the blocked composite form.
    compiled_core = torch.compile(attention_core, options=inductor_options(ParallelContext.single()))

    def attention(core=attention_core):
        for _ in range(mbs * m.num_layers):
            core(q, k, v).backward(grad_out)

    def loss():  # in place on one buffer, as the fused loss does (softmax of a softmax: same work)
        for _ in range(mbs):
            _local_softmax_stats_(logits, labels, -100, 0.0)

    return {"attention": attention, "attention_compiled": lambda: attention(compiled_core), "loss": loss,
            "optimizer": adamw.step}


def gemm_share(steps: int) -> dict:
    """paratron's layout (1) step, eager and compiled, in turn; the GEMMs alone between them."""

    steps_by_name, cfg = {}, None
    for name, extra in (("eager", []), ("compiled", ["model.compile=true"])):
        cfg = load_config(ROOT / "configs/default.toml", LAYOUT_1 + extra)
        ctx = ParallelContext.single()
        torch.manual_seed(0)
        chunks, ddp, opt, sched = build_model_and_optimizer(cfg, ctx)
        mbs = _batches(cfg)
        steps_by_name[name] = lambda c=cfg, x=ctx, ch=chunks, d=ddp, o=opt, s=sched, b=mbs: train_batch(c, x, ch, d, o, s, b)
    floor = floor_parts(cfg)
    names, warmup, ops = ["gemm", "eager", "compiled", *floor], 3, gemm_operands(cfg)
    cpu = {n: [] for n in names}  # this thread's CPU seconds of each timed call
    # Of that CPU time, the kernel's (system) part and the page faults behind most of it: a
    # fresh large tensor is mapped from the OS and its pages are faulted in (and zeroed) on
    # first touch, which thread_time counts and a GEMM into a preallocated output never pays.
    sys_s = {n: [] for n in names}
    faults = {n: [] for n in names}

    def run(name, step):
        r0, c0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time()
        if name == "gemm":
            run_gemms(cfg, ops)
        elif name in floor:
            floor[name]()
        else:
            steps_by_name[name]()
        if step >= warmup:
            r1 = resource.getrusage(resource.RUSAGE_THREAD)
            cpu[name].append(time.thread_time() - c0)
            sys_s[name].append(r1.ru_stime - r0.ru_stime)
            faults[name].append(r1.ru_minflt - r0.ru_minflt)

    times = time_paired(names, steps, run, sync=lambda: None, reduce=lambda t: t, warmup=warmup)
    out = summarize(times, base="eager", pairs=[("gemm", "eager"), ("gemm", "compiled")])
    out["gemm_share_eager"] = out.pop("paired_gemm_vs_eager")
    out["gemm_share_compiled"] = out.pop("paired_gemm_vs_compiled")
    # The same ratios in CPU time: on a loaded machine wall time also counts the time the
    # scheduler gave other processes, which falls on the longer calls unevenly.
    out["cpu_median_ms"] = {n: round(statistics.median(v) * 1e3, 2) for n, v in cpu.items()}
    out["cpu_system_median_ms"] = {n: round(statistics.median(v) * 1e3, 2) for n, v in sys_s.items()}
    out["page_faults_median"] = {n: statistics.median(v) for n, v in faults.items()}
    out["cpu_gemm_share_eager"] = paired_ratio(cpu["gemm"], cpu["eager"])
    out["cpu_gemm_share_compiled"] = paired_ratio(cpu["gemm"], cpu["compiled"])
    out.update(ceiling(cpu))
    out["gemm_flops_per_step"] = 6 * sum(k * n for k, n in linear_shapes(cfg)) * cfg.train.global_batch_size * cfg.model.seq_length
    return out


def wrapper_pair(steps: int) -> dict:
    """The compiled layout-(1) step with inductor's Python wrapper (torch's default) against the
    C++ wrapper that ``model.compile`` uses in a one-process CPU run: two copies of the model in one process,
    each layer compiled with one setting, timed in turn (CPU time, paired)."""
    cfg = load_config(ROOT / "configs/default.toml", LAYOUT_1)
    variants = {}
    for name, options in (("python_wrapper", None), ("cpp_wrapper", inductor_options(ParallelContext.single()))):
        ctx = ParallelContext.single()
        torch.manual_seed(0)
        chunks, ddp, opt, sched = build_model_and_optimizer(cfg, ctx)
        for layer in (l for c in chunks for l in c.layers.values()):
            layer.compile(options=options)
        mbs = _batches(cfg)
        variants[name] = lambda x=ctx, ch=chunks, d=ddp, o=opt, s=sched, b=mbs: train_batch(cfg, x, ch, d, o, s, b)
    cpu = {n: [] for n in variants}

    def run(name, step):
        c0 = time.thread_time()
        variants[name]()
        if step >= 3:
            cpu[name].append(time.thread_time() - c0)

    times = time_paired(list(variants), steps, run, sync=lambda: None, reduce=lambda t: t)
    out = summarize(times, base="python_wrapper")
    out["cpu_median_ms"] = {n: round(statistics.median(v) * 1e3, 2) for n, v in cpu.items()}
    out["cpu_paired_cpp_vs_python"] = paired_ratio(cpu["cpp_wrapper"], cpu["python_wrapper"])
    return out


def ceiling(cpu: dict[str, list[float]]) -> dict:
    """Per timed step (CPU time), for the eager and the compiled step: the GEMM share's ceiling
    ``gemm / (gemm + attention + loss + optimizer)``, with the attention that step runs, and the
    step's remainder beyond those four, as paired medians."""
    out = {}
    for step, attention in (("eager", "attention"), ("compiled", "attention_compiled")):
        fixed = [sum(parts) for parts in zip(cpu["gemm"], cpu[attention], cpu["loss"], cpu["optimizer"])]
        out[f"cpu_ceiling_share_{step}"] = paired_ratio(cpu["gemm"], fixed)
        rest = [total - f for total, f in zip(cpu[step], fixed)]
        out[f"cpu_remainder_ms_{step}"] = round(statistics.median(rest) * 1e3, 2)
    return out


def _batches(cfg) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    m, b, s = cfg.train.global_batch_size // cfg.train.micro_batch_size, cfg.train.micro_batch_size, cfg.model.seq_length
    v = cfg.model.vocab_size
    return [{"tokens": torch.randint(0, v, (b, s), generator=g), "labels": torch.randint(0, v, (b, s), generator=g)}
            for _ in range(m)]


def step_overhead(rounds: int, steps: int) -> dict:
    from bench_model import RefModel

    from paratron.models.gpt import gather_full_state

    cfg = load_config(ROOT / "configs/default.toml", LAYOUT_1)
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
    ap.add_argument("--part", choices=("all", "overhead", "gemm", "wrapper"), default="all")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gemm-steps", type=int, default=MIN_TIMED_STEPS)
    ap.add_argument("--glibc-defaults", action="store_true",
                    help="leave glibc's malloc defaults (paratron train with train.keep_host_memory=false)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # As `paratron train` does before building the model (train.keep_host_memory, on by default);
    # every timed loop of this process, plain PyTorch's included, runs under the same setting.
    kept = keep_host_memory_if_cpu(not args.glibc_defaults)
    print(json.dumps({"keep_host_memory": kept}), flush=True)
    if args.part == "wrapper":
        before = load()
        pair = wrapper_pair(args.gemm_steps)
        print(json.dumps({"load_before": before, "load_after": load(), **pair}, indent=1), flush=True)
        return
    if args.part in ("all", "gemm"):
        before = load()
        share = gemm_share(args.gemm_steps)
        print(json.dumps({"load_before": before, "load_after": load(), **share}, indent=1), flush=True)
    if args.part == "gemm":
        return
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
