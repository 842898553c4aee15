"""BOOST's bottleneck tensor parallelism for low-rank (CoLA) models, and the naive plan it is
measured against (paratron/models/low_rank.py, docs/boost.md): parity with one process, the comm
ledger against the planner's formulas, the byte ratios, and the recompute option's memory."""

from __future__ import annotations

import pytest
import torch

from paratron.config import Config, ConfigError, ModelConfig, validate
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.planner import communication as comm
from paratron.planner.layout import Layout
from paratron.planner.shape import Shape
from paratron.testing import run_ranks

from helpers import assert_parity, train_for_parity

TOL = 1e-5
LLAMA = dict(normalization="rmsnorm", position_embedding_type="rope", activation="swiglu", add_bias_linear=False)


def _model(**kw) -> ModelConfig:
    """A 2-layer Llama-style model with r = h/4 (hidden 32, 4 heads, SwiGLU of 64)."""
    return ModelConfig(**{**LLAMA, **dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                          seq_length=8, ffn_hidden_size=64, low_rank=8), **kw})


def _config(plan="naive", tp=1, sp=False, recompute=False, world=1, **model) -> Config:
    cfg = Config()
    cfg.model = _model(low_rank_tp=plan, low_rank_recompute=recompute, **model)
    p, t, o = cfg.parallel, cfg.train, cfg.optimizer
    p.tensor, p.sequence_parallel, p.bucket_size_mb = tp, sp, 0.001
    t.micro_batch_size, t.global_batch_size, t.seed = 2, 4, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 1.0, "constant"
    return validate(cfg, world)


def _train_rank(kw: dict, world: int) -> dict:
    cfg = _config(world=world, **kw)
    return train_for_parity(cfg, ParallelContext.build(tp=cfg.parallel.tensor), steps=3)


LAYOUTS = {
    "naive-tp2": dict(plan="naive", tp=2),
    "naive-tp2-sp": dict(plan="naive", tp=2, sp=True),
    "bottleneck-tp2": dict(plan="bottleneck", tp=2),
    "bottleneck-tp2-recompute": dict(plan="bottleneck", tp=2, recompute=True),
    "naive-tp4-sp": dict(plan="naive", tp=4, sp=True),
    "bottleneck-tp4": dict(plan="bottleneck", tp=4),
}


@pytest.fixture(scope="module")
def reference() -> dict:
    ref = train_for_parity(_config(), ParallelContext.single(), steps=3)
    # The control: the low-rank model is really another model than the full-rank one.
    full = train_for_parity(_config(low_rank=0), ParallelContext.single(), steps=3)
    assert all(abs(a - b) > 1e-3 for a, b in zip(ref["losses"], full["losses"])), (ref["losses"], full["losses"])
    return ref


@pytest.mark.parametrize("name", [n for n in LAYOUTS if "tp4" not in n])
def test_low_rank_tp2_matches_one_process(name, reference):
    """3 AdamW steps of both plans at TP=2 (naive with and without SP, bottleneck with and
    without recompute) match one process within 1e-5, params and losses."""
    kw = LAYOUTS[name]
    assert_parity(run_ranks(_train_rank, kw["tp"], kw, kw["tp"], timeout=300), reference, TOL, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if "tp4" in n])
def test_low_rank_tp4_matches_one_process(name, reference):
    kw = LAYOUTS[name]
    assert_parity(run_ranks(_train_rank, kw["tp"], kw, kw["tp"], timeout=600), reference, TOL, name)
