"""Mixed precision, early config errors, the FLOPs formula, presets and the MoE hook of the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.config import Config, ConfigError, ModelConfig
from paratron.rules import load_config, validate
from paratron.models.flops import flops_per_token, forward_flops_per_token
from paratron.models.gpt import build_model_chunks
from paratron.models.presets import PRESETS, preset
from paratron.config.model_shape import check_model, ffn_size
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

VOCAB = 64


def _loss_and_grads(dtype: torch.dtype, kind: str):
    cfg = preset(f"{kind}-tiny", vocab_size=VOCAB, num_layers=2, seq_length=16)
    (model,) = build_model_chunks(cfg, ParallelContext.single(), seed=2, params_dtype=dtype)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    losses = model(ids, ids)
    assert losses.dtype == torch.float32  # the loss stays fp32 whatever the compute dtype
    loss = losses.mean()
    loss.backward()
    for p in model.parameters():
        assert p.dtype == dtype and p.grad is not None and p.grad.dtype == dtype
        assert torch.isfinite(p.grad.float()).all(), p.meta.logical_name
    return loss.item()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_close_to_fp32(kind, dtype):
    ref = _loss_and_grads(torch.float32, kind)
    low = _loss_and_grads(dtype, kind)
    assert abs(low - ref) < 2e-2, (low, ref)


def test_query_groups_not_dividing_heads_fails_early():
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=3, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=r"model\.num_attention_heads=8 is not divisible by model\.num_query_groups=3"):
        build_model_chunks(cfg, ParallelContext.single(), seed=0)
    with pytest.raises(ConfigError, match="model.num_query_groups=3"):
        validate(Config(model=cfg))


def _heads_tp4_rank():
    cfg = ModelConfig(num_layers=1, hidden_size=48, num_attention_heads=6, vocab_size=VOCAB)
    ctx = ParallelContext.build(tp=4)
    with ctx.ledger.recording():
        try:
            build_model_chunks(cfg, ctx, seed=0)
        except ConfigError as e:
            return str(e), ctx.ledger.total().calls
    return "no error", ctx.ledger.total().calls


def test_six_heads_at_tp4_fails_before_any_collective():
    for message, calls in run_ranks(_heads_tp4_rank, 4, timeout=240):
        assert "model.num_attention_heads=6" in message and "parallel.tensor=4" in message, message
        assert calls == 0
    with pytest.raises(ConfigError, match="model.num_attention_heads=6 is not divisible by parallel.tensor=4"):
        check_model(ModelConfig(hidden_size=48, num_attention_heads=6, vocab_size=VOCAB), 4)


def test_kv_groups_must_divide_by_tp_and_vocab_must_be_set():
    with pytest.raises(ConfigError, match="model.num_query_groups=2 is not divisible by parallel.tensor=4"):
        check_model(ModelConfig(hidden_size=64, num_attention_heads=8, num_query_groups=2, vocab_size=VOCAB), 4)
    with pytest.raises(ConfigError, match="model.vocab_size=None"):
        check_model(ModelConfig(), 1)


def test_flops_match_narayanan_closed_form():
    # GPT-2 shape (MHA, 4h MLP): 72 l h^2 (1 + s/(6h) + V/(12 l h)) per token (Narayanan et al. 2021).
    cfg = preset("gpt2-small")
    l, h, s, V = cfg.num_layers, cfg.hidden_size, cfg.seq_length, cfg.vocab_size
    expected = 72 * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    assert flops_per_token(cfg) == pytest.approx(expected, rel=1e-12)
    # Full recompute runs one more forward of the layers (the output layer is not recomputed).
    full = dataclasses.replace(cfg, recompute="full")
    assert flops_per_token(full, include_recompute=True) == pytest.approx(
        expected + 24 * l * h * h * (1 + s / (6 * h)), rel=1e-12)
    assert flops_per_token(full) == pytest.approx(expected, rel=1e-12)


def test_flops_gqa_swiglu_moe_terms():
    base = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=100, seq_length=32,
                       activation="swiglu", ffn_hidden_size=128)
    h, f, s = 64, 128, 32
    per_layer = 2 * h * 3 * h + 2 * h * h + 4 * s * h + 3 * 2 * h * f
    assert forward_flops_per_token(base) == pytest.approx(2 * per_layer + 2 * h * 100)
    gqa = dataclasses.replace(base, num_query_groups=2)  # K and V shrink from h to h/4 wide
    assert forward_flops_per_token(base) - forward_flops_per_token(gqa) == pytest.approx(2 * 2 * h * (2 * h - h // 2))
    moe = dataclasses.replace(base, num_experts=8, moe_top_k=2, moe_layer_freq=2, moe_ffn_hidden_size=32)
    # Layer 0 is MoE (2 active experts of width 32 + router), layer 1 dense.
    moe_mlp = 2 * 3 * 2 * h * 32 + 2 * h * 8
    assert forward_flops_per_token(moe) == pytest.approx(forward_flops_per_token(base) - 3 * 2 * h * f + moe_mlp)


def test_presets_and_toml_configs_agree():
    assert {"gpt2-small", "llama-small", "gpt2-tiny", "llama-tiny"} <= set(PRESETS)
    for name in ("gpt2-small", "llama-small"):
        cfg = preset(name)
        validate(Config(model=cfg))
        check_model(cfg, 4)
    assert ffn_size(preset("llama-small", ffn_hidden_size=None)) == 2048  # 8*768/3 = 2048 exactly
    for kind in ("gpt2", "llama"):
        from_file = load_config(f"configs/{kind}-tiny.toml").model
        assert dataclasses.asdict(from_file) == dataclasses.asdict(preset(f"{kind}-tiny"))
    with pytest.raises(ConfigError, match="did you mean 'gpt2-small'"):
        preset("gpt2-smal")
    with pytest.raises(TypeError):
        PRESETS["gpt2-small"]["num_layers"] = 3  # read-only


def test_moe_hook_places_moe_layers_by_frequency():
    from paratron.models.moe.layer import MoELayer
    from paratron.models.mlp import MLP

    cfg = preset("llama-tiny", vocab_size=VOCAB, num_layers=4, seq_length=16, num_experts=4, moe_top_k=2,
                 moe_layer_freq=2)
    (model,) = build_model_chunks(cfg, ParallelContext.single(), seed=2)
    kinds = [type(model.layers[str(i)].mlp) for i in range(4)]
    assert kinds == [MoELayer, MLP, MoELayer, MLP]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    model(ids, ids).mean().backward()
    names = {p.meta.logical_name for p in model.parameters() if p.grad is not None}
    assert any(n.startswith("layers.0.mlp.") for n in names)
    assert "layers.1.mlp.fc2.weight" in names


class _ScaledResidualBlock(torch.nn.Module):
    """A test block: the standard layer with its residual update halved."""

    def __init__(self, cfg, ctx, **kw):
        super().__init__()
        from paratron.models.layer import TransformerLayer

        self.inner = TransformerLayer(cfg, ctx, **kw)

    def forward(self, x, rope=None):
        return x + 0.5 * (self.inner(x, rope) - x)


def test_block_registry_selects_the_layer_class():
    from paratron.models.blocks import register_block
    from paratron.registry import Registry

    name = "test-scaled-residual"
    register_block(name, _ScaledResidualBlock, replace=True)
    base = preset("llama-tiny", vocab_size=VOCAB, seq_length=16)
    custom = dataclasses.replace(base, block=name)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    (a,) = build_model_chunks(base, ParallelContext.single(), seed=2)
    (b,) = build_model_chunks(custom, ParallelContext.single(), seed=2)
    assert all(isinstance(layer, _ScaledResidualBlock) for layer in b.layers.values())
    # Same parameters (same logical names and seeds), different computation.
    assert {p.meta.logical_name for p in a.parameters()} == {p.meta.logical_name for p in b.parameters()}
    assert not torch.allclose(a(ids, ids), b(ids, ids))
    with pytest.raises(ConfigError, match="model.block='transformr'.*did you mean 'transformer'"):
        build_model_chunks(dataclasses.replace(base, block="transformr"), ParallelContext.single(), seed=2)
    registry = Registry("block", "model.block")
    registry.register("x", _ScaledResidualBlock)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("x", _ScaledResidualBlock)


def test_model_constructor_leaves_the_global_rng_alone():
    """Building a model with dropout draws nothing from, and reseeds nothing of, PyTorch's global
    generators (the training setup seeds them; README: no global state)."""
    cfg = preset("llama-tiny", vocab_size=VOCAB, seq_length=16, hidden_dropout=0.1, attention_dropout=0.1)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    (model,) = build_model_chunks(cfg, ParallelContext.single(), seed=2)
    assert model.rng_tracker is not None
    assert torch.equal(torch.get_rng_state(), before)
