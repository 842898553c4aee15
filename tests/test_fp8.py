"""FP8 linears (paratron/layers/fp8.py): the scaled matmul itself, layout-independent scales
(TP2+SP, TP4, PP2 and ZeRO-3 DP2 against one process), the control run without FP8, the
precision rules and the config fields."""

from __future__ import annotations

import pytest
import torch

from paratron.config import Config, ConfigError
from paratron.rules import validate
from paratron.config.aliases import megatron_overrides
from paratron.layers.fp8 import E4M3, E5M2, Fp8Recipe, fp8_matmul, quantize, recipe_of
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

from helpers import gpt2_config, train_for_parity

LOSS_TOL = 1e-6


def test_quantize_scales_and_round_trips():
    t = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.25, -0.125]])
    q, inv = quantize(t, E4M3, None)
    assert q.dtype == E4M3 and inv.shape == ()
    assert q.float().abs().max() == torch.finfo(E4M3).max  # the amax maps onto the format's max
    torch.testing.assert_close(q.float() * inv, t, rtol=0.07, atol=0)
    q, inv = quantize(t, E5M2, 1)
    assert inv.shape == (2, 1)
    assert (q.float().abs().amax(dim=1) == torch.finfo(E5M2).max).all()  # each row reaches max


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_scaled_mm_equals_the_emulated_fp8_product(scaling):
    """torch._scaled_mm on CPU equals casting to FP8 and back and multiplying in fp32."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 24, generator=g)
    recipe = Fp8Recipe(scaling, E5M2)
    out = fp8_matmul(recipe, a, b, "gw", (False, False), False, None)
    dim_a, dim_b = (1, 0) if scaling == "rowwise" else (None, None)
    qa, sa = quantize(a, E5M2, dim_a)
    qb, sb = quantize(b, E4M3, dim_b)
    torch.testing.assert_close(out, (qa.float() * sa) @ (qb.float() * sb), rtol=1e-6, atol=1e-6)
    assert (out - a @ b).abs().max() > 1e-3  # really quantised


def test_fp8_config_fields_and_megatron_aliases():
    cfg = Config()
    assert recipe_of(cfg.train) is None
    overrides, rest = megatron_overrides(["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"])
    assert set(overrides) == {"train.fp8_format=hybrid", "train.fp8=rowwise"} and not rest
    cfg.train.fp8_format = "e4m3"
    assert recipe_of(cfg.train) == Fp8Recipe("tensorwise", E4M3)  # the format alone turns FP8 on
    cfg.train.fp8, cfg.train.fp8_format = "rowwise", None
    assert recipe_of(cfg.train) == Fp8Recipe("rowwise", E5M2)  # hybrid by default
    cfg.train.fp8 = "delayed"
    with pytest.raises(ConfigError, match="train.fp8='delayed'"):
        validate(cfg, 1)
    cfg.train.fp8 = "tensorwise"
    cfg.train.fp8_param_gather = True
    with pytest.raises(ConfigError, match="train.fp8_param_gather=true needs parallel.zero=3"):
        validate(cfg, 1)
    cfg.train.fp8_param_gather, cfg.parallel.context = False, 2
    with pytest.raises(ConfigError, match="train.fp8 needs parallel.context=1"):
        validate(cfg, 2)
    cfg.train.fp8_param_gather, cfg.parallel.context = True, 1
    cfg.parallel.zero, cfg.train.fp8 = 3, "rowwise"
    with pytest.raises(ConfigError, match="train.fp8_param_gather=true needs train.fp8='tensorwise'"):
        validate(cfg, 1)


def _config(fp8="tensorwise", tp=1, pp=1, sp=False, zero=0, gather=False, world=1, precision="fp32") -> Config:
    cfg = Config()
    cfg.model = gpt2_config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8)
    p, t, o = cfg.parallel, cfg.train, cfg.optimizer
    p.tensor, p.pipeline, p.sequence_parallel, p.zero, p.bucket_size_mb = tp, pp, sp, zero, 0.001
    t.micro_batch_size, t.global_batch_size, t.seed, t.fp8 = 1, 4, 1234, fp8
    t.fp8_param_gather, t.precision = gather, precision
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 1.0, "constant"
    return validate(cfg, world)


def _rank(fp8, kw, world):
    cfg = _config(fp8, world=world, **kw)
    p = cfg.parallel
    return train_for_parity(cfg, ParallelContext.build(tp=p.tensor, pp=p.pipeline), steps=3)["losses"]


LAYOUTS = {"tp2-sp": (2, dict(tp=2, sp=True)), "tp4": (4, dict(tp=4)), "pp2": (2, dict(pp=2)),
           "zero3-dp2": (2, dict(zero=3)), "zero3-dp2-fp8-gather": (2, dict(zero=3, gather=True))}


def _check_layouts(fp8: str, names) -> None:
    names = [n for n in names if fp8 == "tensorwise" or "gather" not in n]  # rowwise refuses it
    ref = train_for_parity(_config(fp8), ParallelContext.single(), steps=3)["losses"]
    control = train_for_parity(_config(None), ParallelContext.single(), steps=3)["losses"]
    # The control: FP8 is really on (its losses differ from the run without it at every step).
    assert all(abs(a - b) > 10 * LOSS_TOL for a, b in zip(ref, control)), (ref, control)
    for name in names:
        world, kw = LAYOUTS[name]
        for rank, losses in enumerate(run_ranks(_rank, world, fp8, kw, world, timeout=300)):
            for step, (got, want) in enumerate(zip(losses, ref, strict=True)):
                assert abs(got - want) <= LOSS_TOL * max(1.0, abs(want)), \
                    f"{fp8} {name} rank {rank} step {step + 1}: loss {got} vs one process {want}"


def test_fp8_tensorwise_losses_do_not_depend_on_the_layout():
    """3 AdamW steps of FP8 (tensorwise) at TP2+SP, TP4, PP2 and ZeRO-3 DP2 (with and without
    the FP8 param gather) match one process to 1e-6 (every amax of a shard is MAX-reduced over
    TP, and the gather's over DP and TP, before the cast)."""
    _check_layouts("tensorwise", LAYOUTS)


@pytest.mark.slow
def test_fp8_rowwise_losses_do_not_depend_on_the_layout():
    _check_layouts("rowwise", LAYOUTS)


def test_fp8_rowwise_tp2_sp_matches_one_process():
    """Rowwise scales are reduced over TP only where a row is split (row-parallel forward,
    column-parallel input grad)."""
    _check_layouts("rowwise", ["tp2-sp"])


def _gather_bytes(fp8_gather: bool):
    """All-gather bytes of one transformer layer's params at ZeRO-3 DP2 (bf16 params), and the
    layer's 2-D weights as gathered, with their exact values."""
    from paratron.training.builders import build_model_and_optimizer

    cfg = _config("tensorwise", zero=3, gather=fp8_gather, world=2, precision="bf16")
    cfg.model.add_bias_linear = False
    ctx = ParallelContext.build()
    chunks, ddp, _, _ = build_model_and_optimizer(cfg, ctx)
    shards = ddp.param_shards
    layer = shards.chunk_units[0][1]  # units: embedding, layer 0, layer 1, head
    weights = [p for p in layer.params if p.dim() == 2]
    with ddp.full_params():
        exact = [w.detach().clone() for w in weights]
    with ctx.ledger.recording():
        shards.hold(layer)
        got = [w.detach().clone() for w in weights]
        shards.release(layer)
    with ddp.full_params():  # checkpoints and writebacks see the exact params
        after = [w.detach().clone() for w in weights]
    return ctx.ledger.total("all_gather").bytes, got, exact, after


def _gather_rank():
    return _gather_bytes(False)[0], _gather_bytes(True)


def test_fp8_param_gather_moves_half_the_bytes_of_bf16():
    """ZeRO-3's FP8 param gather moves one byte per weight element instead of two (the layer's
    norms still travel in bf16: about 1 % here), by the comm ledger; the gathered weights are
    the e4m3 casts of the whole weights, and full_params still gives the exact ones."""
    for bf16_bytes, (fp8_bytes, got, exact, after) in run_ranks(_gather_rank, 2, timeout=300):
        # 0.513 here: h=32, and the norms' 128 bf16 values are padded to the rank holding most.
        assert 0.5 <= fp8_bytes / bf16_bytes < 0.52, (fp8_bytes, bf16_bytes)
        for g, e, a in zip(got, exact, after, strict=True):
            q, inv = quantize(e, E4M3, None)
            torch.testing.assert_close(g, (q.float() * inv).to(g.dtype), rtol=0, atol=0)
            assert not torch.equal(g, e)
            assert torch.equal(a, e)


def test_fp8_covers_the_dense_linears_only():
    """Precision rules: FP8 goes to attention QKV/projection and MLP fc1/fc2; the embedding, the
    output head and the norms keep their own paths (no ``fp8`` recipe)."""
    from paratron.layers.fp8 import enable_fp8
    from paratron.models.gpt import build_model_chunks

    cfg = _config()
    chunks = build_model_chunks(cfg.model, ParallelContext.single(), seed=0)
    assert enable_fp8(chunks, recipe_of(cfg.train)) == 4 * cfg.model.num_layers
    on = {name.split(".")[-1] for name, m in chunks[0].named_modules() if getattr(m, "fp8", None) is not None}
    assert on == {"qkv", "proj", "fc1", "fc2"}, on
