"""Qwen3 and Qwen3-MoE (fp32): QK-norm (the norm over each head's q and k before RoPE), a head
width apart from h / heads (``model.kv_channels``), no QKV bias, and Qwen3-MoE's renormalised
top-k; a tiny model of each trained for 3 AdamW steps at TP=2 x PP=2, TP=2 + SP and CP=2
(Ulysses: heads of kv_channels width exchanged) for the dense model, QK-norm grads summed over TP,
and at EP=2 for the MoE, against one process."""

from __future__ import annotations

import pytest
import torch

from paratron.config import Config, ConfigError, ModelConfig
from paratron.rules import validate
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

from helpers import assert_parity, train_for_parity

# fp32 rounding, amplified by 3 Adam steps where a grad nearly cancels: the one-process output
# layer's loss statistics come from one softmax kernel, a TP rank's from split sums and an
# all-reduce (seen up to 1.3e-5 on single elements on another CPU); a real fault is ~1e-2.
TOL = 3e-5


def _model(moe: bool, **kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                qk_layernorm=True, ffn_hidden_size=32, vocab_size=40, seq_length=8, make_vocab_size_divisible_by=8,
                normalization="rmsnorm", norm_epsilon=1e-6, position_embedding_type="rope", rope_theta=1e6,
                activation="swiglu", add_bias_linear=False, tie_embeddings=False)
    if moe:
        base.update(num_layers=2, num_experts=4, moe_top_k=2, moe_ffn_hidden_size=12, moe_router_norm_topk_prob=True,
                    moe_aux_loss_coeff=1e-3)
    base.update(kw)
    return ModelConfig(**base)


def test_qk_norm_normalises_each_head_before_rope():
    """Scaling one head's query by 3 leaves the output unchanged (the norm removes it), and the
    norm weights are [kv_channels] and named like Hugging Face's ``q_norm`` / ``k_norm``."""
    cfg = _model(False, num_layers=1)
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
    attn = chunk.layers["0"].attention
    assert attn.q_norm.weight.shape == (8,) and attn.k_norm.weight.meta.logical_name == "layers.0.attention.k_norm.weight"
    assert attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 16) and attn.proj.weight.shape == (16, 32)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = attn(x)
        attn.qkv.weight[:8] *= 3.0  # the first query head of group 0
        torch.testing.assert_close(attn(x), ref, rtol=1e-5, atol=1e-5)
        attn.q_norm.weight[0] += 0.5  # ... but the norm's own weight counts
        assert not torch.allclose(attn(x), ref, atol=1e-4)


@pytest.mark.parametrize("fields, message", [
    (dict(kv_channels=None, hidden_size=18), "hidden_size=18 is not divisible by model.num_attention_heads=4 "
                                             r"\(or set model.kv_channels"),
    (dict(kv_channels=7), "RoPE needs an even head dim; model.kv_channels = 7"),
    (dict(kv_channels=0), "model.kv_channels=0 must be a positive integer"),
])
def test_bad_head_sizes_are_named_before_launch(fields, message):
    cfg = Config()
    cfg.model = _model(False, **fields)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)


def _config(moe: bool, tp=1, pp=1, ep=1, sp=False, cp=1, world=1) -> Config:
    cfg = Config()
    cfg.model = _model(moe)
    p, t, o = cfg.parallel, cfg.train, cfg.optimizer
    p.tensor, p.pipeline, p.expert, p.sequence_parallel, p.bucket_size_mb = tp, pp, ep, sp, 0.001
    p.context, p.context_algorithm = cp, "all2all"
    t.micro_batch_size, t.global_batch_size, t.seed = 1, 4, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 1.0, "constant"
    return validate(cfg, world)


def _rank(moe, kw, world):
    cfg = _config(moe, world=world, **kw)
    p = cfg.parallel
    return train_for_parity(cfg, ParallelContext.build(tp=p.tensor, pp=p.pipeline, ep=p.expert, cp=p.context),
                            steps=3)


LAYOUTS = {"dense-tp2-pp2": (False, 4, dict(tp=2, pp=2)), "dense-tp2-sp": (False, 2, dict(tp=2, sp=True)),
           "dense-cp2-all2all": (False, 2, dict(cp=2)), "moe-ep2": (True, 2, dict(ep=2))}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_qwen3_parity(name):
    """3 AdamW steps (clipping, weight decay) match one process to 1e-5, QK-norm weights
    included: their grads are partial on each TP rank (each normalises its own heads) and summed
    over TP; without that sum the TP layouts drift."""
    moe, world, kw = LAYOUTS[name]
    results = run_ranks(_rank, world, moe, kw, world, timeout=300)
    ref = train_for_parity(_config(moe), ParallelContext.single(), steps=3)
    assert "layers.1.attention.q_norm.weight" in ref["params"]
    assert_parity(results, ref, TOL, name)


def test_the_tiny_qwen3_moe_run_config_validates():
    from paratron.rules import load_config
    from paratron.config.model_shape import is_moe_layer

    cfg = load_config("configs/qwen3-moe-tiny.toml")
    cfg.model.vocab_size = 2048
    validate(cfg, 2)
    assert cfg.model.qk_layernorm and [is_moe_layer(cfg.model, i) for i in range(3)] == [False, True, True]
