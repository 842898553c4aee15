"""Parity of the full GPTChunk at TP=2 (with and without sequence parallelism) against one process:
per-token losses and every gathered gradient within 1e-5 (fp32), for a Llama-style (GQA, RoPE,
SwiGLU, RMSNorm, untied) and a GPT-2-style (learned positions, GELU, LayerNorm, biases, tied) model.
Also: a two-stage pipeline layout builds the same parameters as one stage.
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.models.gpt import build_model_chunks, model_order
from paratron.pipeline.partition import stage_layers
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import allreduce_sequence_parallel_grads
from paratron.parallel.params import gather_full
from paratron.local_ranks import run_ranks

from helpers import perturb_1d_params_

TOL = 1e-5
SEQ, BATCH, VOCAB = 8, 2, 61

CONFIGS = {
    "llama": dict(normalization="rmsnorm", position_embedding_type="rope", activation="swiglu",
                  add_bias_linear=False, tie_embeddings=False, num_query_groups=2, ffn_hidden_size=48),
    "gpt2": dict(normalization="layernorm", position_embedding_type="learned", activation="gelu_tanh",
                 add_bias_linear=True, tie_embeddings=True),
}


def _cfg(kind: str) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                       seq_length=SEQ, **CONFIGS[kind])


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, :2] = -100  # ignored positions count 0
    return ids, labels


def _run(kind: str, tp: int, sp: bool):
    cfg = _cfg(kind)
    ctx = ParallelContext.single() if tp == 1 else ParallelContext.build(tp=tp)
    chunks = build_model_chunks(cfg, ctx, seed=5, sequence_parallel=sp)
    perturb_1d_params_(chunks)
    (model,) = chunks
    ids, labels = _batch()
    losses = model(ids, labels)
    valid = (labels != -100).sum()
    (losses.sum() / valid).backward()
    params = list(model.parameters())
    allreduce_sequence_parallel_grads(params, ctx)
    grads = {}
    for p in params:
        grads[p.meta.logical_name] = gather_full(p.grad, p, ctx.tp).clone()
    return losses.detach(), grads


def _tp_rank(kind, sp):
    return _run(kind, 2, sp)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_chunk_tp2_matches_single(kind, sp):
    ref_losses, ref_grads = _run(kind, 1, False)
    assert ref_losses.shape == (SEQ, BATCH) and ref_losses.dtype == torch.float32
    assert torch.all(ref_losses[:2, 0] == 0)
    results = run_ranks(_tp_rank, 2, kind, sp, timeout=240)
    for losses, grads in results:
        assert (losses - ref_losses).abs().max().item() < TOL
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert g.abs().max() > 0, f"{name} has no grad in the reference"
            err = (grads[name] - g).abs().max().item()
            assert err < TOL, f"{name}: max |grad diff| {err:.3g}"


def _pp_rank(kind):
    cfg = _cfg(kind)
    ctx = ParallelContext.build(pp=2)
    chunks = build_model_chunks(cfg, ctx, seed=5)
    (chunk,) = chunks
    return {
        "pre": chunk.pre_process, "post": chunk.post_process, "layers": list(chunk.layer_ids),
        "params": {p.meta.logical_name: (p.detach().clone(), p.meta.shared_embedding) for p in chunk.parameters()},
    }


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_two_stage_layout_builds_the_same_parameters(kind):
    (single,) = build_model_chunks(_cfg(kind), ParallelContext.single(), seed=5)
    ref = {p.meta.logical_name: p.detach() for p in single.parameters()}
    first, last = run_ranks(_pp_rank, 2, kind, timeout=240)
    assert (first["pre"], first["post"], first["layers"]) == (True, False, [0])
    assert (last["pre"], last["post"], last["layers"]) == (False, True, [1])
    names = set(first["params"]) | set(last["params"])
    assert names == set(ref)
    for stage in (first, last):
        for name, (t, shared) in stage["params"].items():
            assert torch.equal(t, ref[name]), name
            # Tied embeddings: both stages hold a copy, both marked for the embedding-group all-reduce.
            assert shared == (kind == "gpt2" and name == "embedding.word_embeddings.weight")
    if kind == "gpt2":
        assert "embedding.word_embeddings.weight" in first["params"] and \
            "embedding.word_embeddings.weight" in last["params"]


def test_stage_layers_order_and_errors():
    layout = stage_layers(8, 2, 2)
    assert layout == {(0, 0): (0, 2), (1, 0): (2, 2), (0, 1): (4, 2), (1, 1): (6, 2)}
    assert model_order(layout, 8) == [(0, 0), (1, 0), (0, 1), (1, 1)]
    # ZBV-like V placement with an embedding-only first stage and a head-only last stage.
    v = {(0, 0): (0, 0), (1, 0): (0, 4), (1, 1): (4, 4), (0, 1): (8, 0)}
    assert model_order(v, 8) == [(0, 0), (1, 0), (1, 1), (0, 1)]
    with pytest.raises(ValueError, match="tile"):
        model_order({(0, 0): (0, 3), (1, 0): (2, 2)}, 4)
    with pytest.raises(Exception, match="model.num_layers=6 is not divisible"):
        stage_layers(6, 4)


def test_zbv_like_placement_on_one_rank_shares_tied_embedding():
    cfg = _cfg("gpt2")
    ctx = ParallelContext.single()
    chunks = build_model_chunks(cfg, ctx, seed=5, stage_layers={(0, 0): (0, 1), (0, 1): (1, 1)})
    assert [c.pre_process for c in chunks] == [True, False]
    assert [c.post_process for c in chunks] == [False, True]
    emb = chunks[0].embedding.word_embeddings.weight
    assert chunks[1].output_weight() is emb and not emb.meta.shared_embedding
    (whole,) = build_model_chunks(cfg, ctx, seed=5)
    ids, labels = _batch()
    assert torch.equal(chunks[1](chunks[0](ids), labels), whole(ids, labels))
