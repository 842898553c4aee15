"""Forward+backward step time of a paratron Llama-style model (TP=PP=DP=1, fp32, one process) against

* a plain PyTorch model of exactly the same math written here (nn.Linear, RMSNorm, SDPA, SwiGLU),
* transformers' ``LlamaForCausalLM`` of the same config,

all three holding the same weights (checked: equal losses). Timings are interleaved round by round
and reported as ratios of medians, so machine load shifts all three alike. Also measures the peak
memory of one training step of a 4-layer model under each recompute mode.

    .venv/bin/python benchmarks/bench_model.py [--rounds 7] [--steps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig
from paratron.models.gpt import build_model_chunks, gather_full_state
from paratron.models.rope import apply_rope, rope_tables
from paratron.parallel.context import ParallelContext


class RefRMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RefLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, n, g = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups
        self.n, self.g, self.d = n, g, h // n
        self.input_norm = RefRMSNorm(h, cfg.norm_epsilon)
        self.qkv = nn.Linear(h, (n + 2 * g) * self.d, bias=False)
        self.proj = nn.Linear(n * self.d, h, bias=False)
        self.post_attention_norm = RefRMSNorm(h, cfg.norm_epsilon)
        self.gate = nn.Linear(h, cfg.ffn_hidden_size, bias=False)
        self.up = nn.Linear(h, cfg.ffn_hidden_size, bias=False)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, h, bias=False)

    def forward(self, x, rope):  # x [s, b, h]
        s, b, _ = x.shape
        qkv = self.qkv(self.input_norm(x)).view(s, b, self.g, self.n // self.g + 2, self.d)
        q = qkv[:, :, :, :-2].reshape(s, b, self.n, self.d)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        o = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                           enable_gqa=True)
        x = x + self.proj(o.permute(2, 0, 1, 3).reshape(s, b, self.n * self.d))
        hN = self.post_attention_norm(x)
        return x + self.fc2(F.silu(self.gate(hN)) * self.up(hN))


class RefModel(nn.Module):
    """The same computation as paratron's Llama-style GPTChunk, in plain PyTorch."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(RefLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RefRMSNorm(cfg.hidden_size, cfg.norm_epsilon)
        self.output_layer = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def load(self, tensors):
        def theirs(name: str) -> str:
            if name == "embedding.weight":
                return "embedding.word_embeddings.weight"
            for short, full in ((".qkv.", ".attention.qkv."), (".proj.", ".attention.proj."),
                                (".gate.", ".mlp.gate."), (".up.", ".mlp.up."), (".fc2.", ".mlp.fc2.")):
                name = name.replace(short, full)
            return name

        tensors = dict(tensors)
        for name in [n for n in tensors if n.endswith(".mlp.fc1.weight")]:  # paratron's fused [gate; up]
            gate, up = tensors.pop(name).chunk(2)
            tensors[name.replace(".fc1.", ".gate.")], tensors[name.replace(".fc1.", ".up.")] = gate, up
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(tensors[theirs(name)])

    def forward(self, ids, labels):
        x = self.embedding(ids.t())
        rope = rope_tables(ids.shape[1], self.cfg.hidden_size // self.cfg.num_attention_heads, self.cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, rope)
        logits = self.output_layer(self.final_norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.t().reshape(-1), reduction="none")


def bench_config(args) -> ModelConfig:
    return ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8, num_query_groups=4,
                       ffn_hidden_size=args.hidden * 8 // 3 // 64 * 64, vocab_size=args.vocab,
                       make_vocab_size_divisible_by=64, seq_length=args.seq, normalization="rmsnorm",
                       position_embedding_type="rope", activation="swiglu", add_bias_linear=False,
                       tie_embeddings=False, norm_epsilon=1e-5)


def time_steps(step, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n


def step_time_ratios(args) -> dict:
    cfg = bench_config(args)
    ctx = ParallelContext.single()
    (ours,) = build_model_chunks(cfg, ctx, seed=0)
    tensors = gather_full_state([ours], ctx)
    ref = RefModel(cfg)
    ref.load(tensors)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_length), generator=torch.Generator().manual_seed(0))

    def our_step():
        ours.zero_grad(set_to_none=True)
        ours(ids, ids).mean().backward()

    def ref_step():
        ref.zero_grad(set_to_none=True)
        ref(ids, ids).mean().backward()

    steps = {"paratron": our_step, "reference": ref_step}
    with torch.no_grad():
        l_ours, l_ref = ours(ids, ids).mean().item(), ref(ids, ids).mean().item()
    assert abs(l_ours - l_ref) < 1e-4, (l_ours, l_ref)
    try:
        import transformers

        from paratron.checkpoint.hf import paratron_to_hf
        with tempfile.TemporaryDirectory() as d:
            paratron_to_hf(cfg, tensors, d)
            hf = transformers.LlamaForCausalLM.from_pretrained(d, attn_implementation="sdpa").train()

        def hf_step():
            hf.zero_grad(set_to_none=True)
            logits = hf(ids).logits
            F.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.reshape(-1)).backward()

        with torch.no_grad():
            l_hf = F.cross_entropy(hf(ids).logits.float().view(-1, cfg.vocab_size), ids.reshape(-1)).item()
        assert abs(l_hf - l_ours) < 1e-4, (l_hf, l_ours)
        steps["transformers"] = hf_step
    except ImportError:
        print("transformers not installed: skipping that comparison")
    for fn in steps.values():  # warm-up
        fn()
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for name, fn in steps.items():
            times[name].append(time_steps(fn, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {f"{k}_ms": round(1e3 * v, 2) for k, v in med.items()}
    out["paratron/reference"] = round(med["paratron"] / med["reference"], 3)
    if "transformers" in med:
        out["paratron/transformers"] = round(med["paratron"] / med["transformers"], 3)
    # Spread of the per-round ratio, to show how much the load moved things.
    per_round = [a / b for a, b in zip(times["paratron"], times["reference"])]
    out["paratron/reference per-round min..max"] = f"{min(per_round):.3f}..{max(per_round):.3f}"
    return out


def recompute_peak_memory(layers: int = 4) -> dict:
    """Peak CPU bytes of one forward+backward per recompute mode (profiler, op granularity)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for mode in ("none", "selective", "full"):
        cfg = ModelConfig(num_layers=layers, hidden_size=128, num_attention_heads=8, num_query_groups=4,
                          ffn_hidden_size=256, vocab_size=512, seq_length=256, normalization="rmsnorm",
                          position_embedding_type="rope", activation="swiglu", add_bias_linear=False,
                          tie_embeddings=False, hidden_dropout=0.1, attention_dropout=0.1, recompute=mode)
        (model,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
        ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(0))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(ids, ids).mean().backward()
        live = peak = 0
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            live += e.self_cpu_memory_usage
            peak = max(peak, live)
        out[mode] = peak
    return {f"peak_MiB_{k}": round(v / 2**20, 2) for k, v in out.items()} | {
        "selective/none": round(out["selective"] / out["none"], 3), "full/none": round(out["full"] / out["none"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--skip-memory", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"config: layers={args.layers} h={args.hidden} heads=8 groups=4 seq={args.seq} batch={args.batch} "
          f"vocab={args.vocab} fp32 threads={args.threads} torch={torch.__version__}")
    for k, v in step_time_ratios(args).items():
        print(f"  {k}: {v}")
    if not args.skip_memory:
        for k, v in recompute_peak_memory().items():
            print(f"  recompute {k}: {v}")


if __name__ == "__main__":
    main()
