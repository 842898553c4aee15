"""Activation recompute (full and selective) gives bitwise the same loss and grads as no recompute
with dropout on (fp32, same seed), on one process and at TP=2 with sequence parallelism; and it
lowers the peak memory of a 4-layer model (measured with the PyTorch profiler's memory timeline).
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import allreduce_sequence_parallel_grads
from paratron.local_ranks import run_ranks

VOCAB = 64


def _cfg(recompute: str, **kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                seq_length=16, normalization="rmsnorm", position_embedding_type="rope", activation="swiglu",
                add_bias_linear=False, tie_embeddings=False, hidden_dropout=0.2, attention_dropout=0.2,
                recompute=recompute)
    base.update(kw)
    return ModelConfig(**base)


def _step(recompute: str, ctx, sp: bool = False, data_seed: int = 0, **kw):
    cfg = _cfg(recompute, **kw)
    (model,) = build_model_chunks(cfg, ctx, seed=3, sequence_parallel=sp)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, cfg.seq_length), generator=g)
    model.rng_tracker.seed_default_stream()
    torch.manual_seed(100 + data_seed)  # the default stream: hidden dropout masks
    losses = model(ids, ids)
    losses.mean().backward()
    params = list(model.parameters())
    allreduce_sequence_parallel_grads(params, ctx)
    return losses.detach(), {p.meta.logical_name: p.grad.clone() for p in params}


def _assert_bitwise(a, b):
    assert torch.equal(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_is_bitwise_equal_with_dropout(mode):
    ctx = ParallelContext.single()
    ref = _step("none", ctx)
    _assert_bitwise(_step(mode, ctx), ref)
    # Dropout is really on: another dropout draw changes the loss.
    assert not torch.equal(_step("none", ctx, data_seed=1)[0], ref[0])


def test_recompute_gpt2_style_full():
    kw = dict(normalization="layernorm", position_embedding_type="learned", activation="gelu",
              add_bias_linear=True, tie_embeddings=True, num_query_groups=None)
    ctx = ParallelContext.single()
    _assert_bitwise(_step("full", ctx, **kw), _step("none", ctx, **kw))


def _tp_rank():
    ctx = ParallelContext.build(tp=2)
    ref = _step("none", ctx, sp=True)
    for mode in ("full", "selective"):
        _assert_bitwise(_step(mode, ctx, sp=True), ref)
    return True


def test_recompute_bitwise_tp2_sequence_parallel():
    # Attention dropout draws from the per-TP-rank stream and, under SP, so does hidden dropout:
    # the recompute must replay the tracker's streams, not only the default generator.
    assert run_ranks(_tp_rank, 2, timeout=240) == [True, True]


def peak_memory_bytes(recompute: str, num_layers: int = 4) -> int:
    """Peak CPU bytes allocated during one forward+backward of a ``num_layers`` model.

    The profiler attributes each allocation and free to the op that made it
    (``self_cpu_memory_usage``, frees negative); the running sum over ops in start order peaks
    where the most bytes were live (at op granularity).
    """
    from torch.profiler import ProfilerActivity, profile

    cfg = _cfg(recompute, num_layers=num_layers, hidden_size=64, seq_length=64, hidden_dropout=0.1,
               attention_dropout=0.1)
    (model,) = build_model_chunks(cfg, ParallelContext.single(), seed=3)
    model.train()
    ids = torch.randint(0, VOCAB, (4, cfg.seq_length), generator=torch.Generator().manual_seed(1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(ids, ids).mean().backward()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_recompute_lowers_peak_memory():
    peaks = {mode: peak_memory_bytes(mode) for mode in ("none", "selective", "full")}
    print("peak bytes, 4 layers:", peaks)
    assert peaks["selective"] < peaks["none"]
    assert peaks["full"] < 0.7 * peaks["none"]
