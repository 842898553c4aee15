"""Multi-head latent attention: KV memory per token against standard multi-head attention at equal
heads, measured, with the formulas beside it.

Two figures per model shape (one layer, fp32, one process):

* **KV cache per token** (what generation keeps per token and layer): multi-head attention keeps
  ``2 n d`` elements (K and V of every head); MLA keeps the latent ``c_kv`` and the shared RoPE key,
  ``kv_lora_rank + qk_pos_emb_head_dim`` (DeepSeek-V2, section 2.1 and table 1). Measured: the
  elements of the tensors each module computes and would cache (MHA: the k and v heads; MLA: the
  ``kv_down`` output), divided by tokens.
* **Saved activations per token** in training (the attention block's forward, autograd's saved
  tensors counted once per storage with ``torch.autograd.graph.saved_tensors_hooks``, weights and
  the block input left out), against
  Korthikanti et al. 2022's attention-block term ``11 s b h + 5 a s^2 b`` bytes at 2-byte
  activations (the formula Megatron-LM's memory estimate uses), doubled here for fp32; SDPA keeps
  no ``s x s`` scores, so the measured value is below the formula's ``5 a s`` part.

Usage: .venv/bin/python benchmarks/bench_mla.py [--seq 256 --batch 2]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from paratron.config import ModelConfig  # noqa: E402
from paratron.models.attention import SelfAttention  # noqa: E402
from paratron.models.mla import LatentAttention  # noqa: E402
from paratron.models.rope import rope_tables  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402

SHAPES = {  # name: (hidden, heads, q_lora_rank, kv_lora_rank, qk_head_dim, rope dim, v_head_dim)
    "DeepSeek-V2-Lite-like (h 2048, 16 heads)": (2048, 16, None, 512, 128, 64, 128),
    "small (h 512, 8 heads)": (512, 8, 192, 128, 64, 32, 64),
}


def _saved_bytes(module, x, rope) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x, rope)
    # Weights are not activations; the block input belongs to the layer before.
    for t in [x, *module.parameters()]:
        storages.pop(t.untyped_storage().data_ptr(), None)
    return sum(storages.values())


def _kv_elements(module, x) -> int:
    """Elements per token of the tensors the module would cache for generation (MLA: the
    ``kv_down`` output; MHA: the K and V heads of its fused QKV output)."""
    with torch.no_grad():
        if isinstance(module, LatentAttention):
            cached = module.kv_down(x)
        else:
            s, b = x.shape[:2]
            qkv = module.qkv(x).view(s, b, module.local_groups, module.q_per_group + 2, module.head_dim)
            cached = qkv[:, :, :, module.q_per_group:]
        return cached.numel() // (x.shape[0] * x.shape[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    a = ap.parse_args()
    ctx = ParallelContext.single()
    s, b = a.seq, a.batch
    print(f"fp32, one layer, s={s}, b={b}; per token; bytes are fp32")
    print(f"{'shape':44s} {'attention':9s} {'KV cache elems (formula)':>25s} {'saved act. bytes (Korthikanti x2)':>34s}")
    for name, (h, n, rq, rkv, dn, dr, dv) in SHAPES.items():
        common = dict(num_layers=1, hidden_size=h, num_attention_heads=n, vocab_size=128, seq_length=s,
                      normalization="rmsnorm", position_embedding_type="rope", activation="swiglu",
                      add_bias_linear=False)
        mha = ModelConfig(**common)
        mla = ModelConfig(**common, multi_latent_attention=True, q_lora_rank=rq, kv_lora_rank=rkv, qk_head_dim=dn,
                          qk_pos_emb_head_dim=dr, v_head_dim=dv)
        x = torch.randn(s, b, h, requires_grad=True)
        for label, cfg, cls, formula_kv in (("MHA", mha, SelfAttention, 2 * n * (h // n)),
                                            ("MLA", mla, LatentAttention, rkv + dr)):
            mod = cls(cfg, ctx, layer_number=0, seed=0, sequence_parallel=False, params_dtype=torch.float32)
            dim = dr if label == "MLA" else h // n
            rope = rope_tables(s, dim, cfg.rope_theta)
            kv = _kv_elements(mod, x)
            saved = _saved_bytes(mod, x, rope) / (s * b)
            korthikanti = 2 * (11 * h + 5 * n * s)  # bytes per token at fp32 (the formula is for 2-byte)
            print(f"{name:44s} {label:9s} {kv:>12d} ({formula_kv:>10d}) {saved:>16.0f} ({korthikanti:>14d})")


if __name__ == "__main__":
    main()
