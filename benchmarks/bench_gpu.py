"""paratron's training step against a plain PyTorch loop on one device, same model and batch.

1. ``paratron train --config configs/llama-1b.toml`` (layout (1), bf16 params, fp32 main grads
   and weights, fused AdamW, clipping) for ``--steps`` steps on the bundled corpus (a 32k
   byte-level BPE trained on it on first use; no downloads). Throughput from its
   ``metrics.jsonl``: tokens over wall time of the steps after ``--warmup``.
2. The same model (vocab from that run) in a plain PyTorch loop written here: ``nn.Linear``,
   ``nn.RMSNorm``, RoPE, SDPA with ``is_causal``, SwiGLU, fp32 params under bf16 autocast,
   ``torch.optim.AdamW(fused=True)``, ``clip_grad_norm_``, the same microbatches per step.

Prints tokens/s, TFLOP/s per device, MFU (peak from paratron's table, or ``--peak``) and peak
memory for both, and the ratios; writes ``OUT/gpu_check.json``. ``--tiny`` runs a 2-layer model
for a few steps on whatever device there is (the CPU test of this script).

    python benchmarks/bench_gpu.py [--steps 30] [--warmup 5] [--out /tmp/paratron-gpu-check] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.ffn_hidden_size=176", "model.seq_length=64",
        "train.micro_batch_size=2", "train.global_batch_size=4", "data.tokenizer_vocab_size=512"]


def run_paratron(args, out: Path) -> tuple[dict, dict]:
    """Train through the CLI; returns (its config as a dict, measured figures)."""
    run_dir = out / "paratron"
    sets = [f"train.train_iters={args.steps}", f"optimizer.lr_warmup_iters={min(5, args.steps)}",
            "checkpoint.save=none", "train.sample_prompt=none"]
    sets += TINY if args.tiny else []
    sets += [f"data.corpus={args.corpus}"] if args.corpus else []
    sets += [f"train.peak_flops_per_device={args.peak}"] if args.peak else []
    cmd = [sys.executable, "-m", "paratron", "train", "--config", str(ROOT / "configs/llama-1b.toml"),
           "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"paratron train failed (exit {proc.returncode})")
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and r["iteration"] > args.warmup]
    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    tokens = cfg["train"]["global_batch_size"] * cfg["model"]["seq_length"]
    return cfg, {"tokens_per_second": tokens * len(steps) / sum(r["step_time_s"] for r in steps),
                 "peak_memory_gib": max(r["peak_memory_mb"] for r in recs if "loss" in r) / 1024,
                 "final_loss": steps[-1]["loss"] if steps else float("nan")}


class PlainLayer(nn.Module):
    def __init__(self, m: dict):
        super().__init__()
        h, self.n, self.g = m["hidden_size"], m["num_attention_heads"], m["num_query_groups"]
        self.d = h // self.n
        self.norm1, self.norm2 = nn.RMSNorm(h, eps=m["norm_epsilon"]), nn.RMSNorm(h, eps=m["norm_epsilon"])
        self.q = nn.Linear(h, self.n * self.d, bias=False)
        self.kv = nn.Linear(h, 2 * self.g * self.d, bias=False)
        self.o = nn.Linear(self.n * self.d, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * m["ffn_hidden_size"], bias=False)
        self.down = nn.Linear(m["ffn_hidden_size"], h, bias=False)

    def forward(self, x, cos, sin):  # x [b, s, h]
        b, s, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.n, self.d).transpose(1, 2)
        k, v = self.kv(y).view(b, s, 2, self.g, self.d).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rotate(x, cos, sin):
    """RoPE (Su et al. 2021) on ``[b, heads, s, d]``, rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PlainLlama(nn.Module):
    def __init__(self, m: dict):
        super().__init__()
        self.embed = nn.Embedding(m["vocab_size"], m["hidden_size"])
        self.layers = nn.ModuleList(PlainLayer(m) for _ in range(m["num_layers"]))
        self.norm = nn.RMSNorm(m["hidden_size"], eps=m["norm_epsilon"])
        self.head = nn.Linear(m["hidden_size"], m["vocab_size"], bias=False)
        d = m["hidden_size"] // m["num_attention_heads"]
        inv = 1.0 / (m["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        ang = torch.outer(torch.arange(m["seq_length"]).float(), inv)
        self.register_buffer("cos", torch.cat([ang, ang], -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat([ang, ang], -1).sin(), persistent=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")


def run_plain(cfg: dict, args, device: torch.device) -> dict:
    m, t, o = cfg["model"], cfg["train"], cfg["optimizer"]
    torch.manual_seed(0)
    model = PlainLlama(m).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=(o["adam_beta1"], o["adam_beta2"]),
                            eps=o["adam_eps"], weight_decay=o["weight_decay"], fused=True)
    micro = t["global_batch_size"] // t["micro_batch_size"]
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, m["vocab_size"], (t["micro_batch_size"], m["seq_length"] + 1), generator=g).to(device)
               for _ in range(micro)]
    tokens = t["global_batch_size"] * m["seq_length"]

    def step():
        opt.zero_grad(set_to_none=True)
        for ids in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(ids[:, :-1], ids[:, 1:]) / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o["clip_grad"])
        opt.step()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps - args.warmup):
        step()
    sync()
    elapsed = time.perf_counter() - t0
    if device.type == "cuda":
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        from paratron.training.metrics import peak_memory_mb

        peak_gib = peak_memory_mb(device) / 1024
    return {"tokens_per_second": tokens * (args.steps - args.warmup) / elapsed, "peak_memory_gib": peak_gib}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="/tmp/paratron-gpu-check")
    ap.add_argument("--tiny", action="store_true", help="2-layer model, seconds on a CPU")
    ap.add_argument("--corpus", help="another JSONL corpus (default: the bundled one)")
    ap.add_argument("--peak", type=float, help="peak FLOP/s per device for MFU (default: the GPU table)")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps={args.steps} must exceed --warmup={args.warmup}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from paratron.config import ModelConfig
    from paratron.models.flops import flops_per_token
    from paratron.parallel.context import default_device
    from paratron.training.metrics import peak_flops_per_device

    device = default_device()
    cfg, ours = run_paratron(args, out)
    plain = run_plain(cfg, args, device)
    fields = {f: cfg["model"][f] for f in ModelConfig.__dataclass_fields__ if f in cfg["model"]}
    flops_tok = flops_per_token(ModelConfig(**fields))
    peak, source = peak_flops_per_device(args.peak, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    for r in (ours, plain):
        r["tflops_per_device"] = flops_tok * r["tokens_per_second"] / 1e12
        r["mfu"] = flops_tok * r["tokens_per_second"] / peak if peak and math.isfinite(peak) else float("nan")
    report = {"device": name, "peak_flops": peak, "peak_source": source, "flops_per_token": flops_tok,
              "steps": args.steps, "warmup": args.warmup, "paratron": ours, "plain_pytorch": plain,
              "ratio_tokens_per_second": ours["tokens_per_second"] / plain["tokens_per_second"]}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"device: {name} | peak {peak / 1e12:.1f} TFLOP/s ({source}) | model FLOPs/token {flops_tok:.3e}")
    print(f"{'':22s}{'paratron':>14s}{'plain PyTorch':>16s}{'ratio':>9s}")
    for key, label, fmt in (("tokens_per_second", "tokens/s", "{:14,.0f}"), ("tflops_per_device", "TFLOP/s per device", "{:14.1f}"),
                            ("mfu", "MFU", "{:14.1%}"), ("peak_memory_gib", "peak memory (GiB)", "{:14.2f}")):
        a, b = ours[key], plain[key]
        print(f"{label:22s}{fmt.format(a)}{fmt.format(b):>16s}{a / b if b else float('nan'):9.3f}")
    print(f"paratron final loss {ours['final_loss']:.4f} | report: {out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
