"""Hugging Face parity: tiny random Llama (GQA, RoPE, SwiGLU, RMSNorm, untied) and GPT-2 (learned
positions, GELU, LayerNorm, tied) models made here, imported into paratron at TP=1, TP=2 and a
two-chunk pipeline split; logits must match transformers to 1e-5 (fp32). Then exported back, reloaded
with transformers, and the logits match again.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.hf import hf_to_paratron, paratron_to_hf  # noqa: E402
from paratron.models.gpt import (GPTChunk, build_model_chunks, full_logits, gather_full_state,  # noqa: E402
                                 load_full_state)
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

TOL = 1e-5
VOCAB, SEQ, BATCH = 97, 12, 2


def _perturb_(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; randomise every tensor so a mis-mapped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def _make_llama(path) -> torch.Tensor:
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _perturb_(model, 1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _make_gpt2(path) -> torch.Tensor:
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    _perturb_(model, 2)
    model.save_pretrained(path, safe_serialization=True)
    return model


MAKERS = {"llama": _make_llama, "gpt2": _make_gpt2}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _paratron_logits(hf_dir, ids, tp: int, export_dir=None) -> torch.Tensor:
    cfg, tensors = hf_to_paratron(hf_dir)
    ctx = ParallelContext.single() if tp == 1 else ParallelContext.build(tp=tp)
    chunks = build_model_chunks(cfg, ctx, seed=0)
    load_full_state(chunks, tensors)
    (model,) = chunks
    model.eval()
    with torch.no_grad():
        logits = full_logits(model(ids), ctx, cfg.vocab_size)
    if export_dir is not None:
        state = gather_full_state(chunks, ctx)
        if ctx.rank == 0:
            paratron_to_hf(cfg, state, export_dir)
    return logits


def _tp_rank(hf_dir, ids, export_dir):
    return _paratron_logits(hf_dir, ids, 2, export_dir)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def hf_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = MAKERS[request.param](path)
    return request.param, path, model


def test_logits_match_transformers_tp1(hf_model):
    _, path, model = hf_model
    ids = _ids()
    ref = _hf_logits(model, ids)
    ours = _paratron_logits(path, ids, 1)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOL


def test_logits_match_transformers_tp2_and_export(hf_model, tmp_path):
    kind, path, model = hf_model
    ids = _ids()
    ref = _hf_logits(model, ids)
    out = tmp_path / "export"
    results = run_ranks(_tp_rank, 2, str(path), ids, str(out), timeout=240)
    for ours in results:
        assert (ours - ref).abs().max().item() < TOL
    # Exported from the TP=2 layout: transformers reloads it and computes the same logits.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    expected_cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel
    assert isinstance(reloaded, expected_cls)
    assert (_hf_logits(reloaded, ids) - ref).abs().max().item() < TOL
    assert reloaded.config.tie_word_embeddings == (kind == "gpt2")


def test_pipeline_split_load(hf_model):
    """Two chunks (embedding + layer 0 | layer 1 + head) loaded from the same tensors: the tied
    GPT-2 head holds its own copy of the embedding, named and loaded like the first stage's."""
    kind, path, model = hf_model
    cfg, tensors = hf_to_paratron(path)
    ctx = ParallelContext.single()
    first = GPTChunk(cfg, ctx, seed=0, layer_ids=range(0, 1), pre_process=True, post_process=False)
    last = GPTChunk(cfg, ctx, seed=0, layer_ids=range(1, 2), pre_process=False, post_process=True)
    load_full_state([first, last], tensors)
    if kind == "gpt2":
        assert last.output_weight() is not first.embedding.word_embeddings.weight
        assert last.output_weight().meta.shared_embedding and first.embedding.word_embeddings.weight.meta.shared_embedding
    ids = _ids()
    with torch.no_grad():
        logits = full_logits(last.eval()(first.eval()(ids)), ctx, cfg.vocab_size)
    assert (logits - _hf_logits(model, ids)).abs().max().item() < TOL


def test_roundtrip_tensors_exact(hf_model, tmp_path):
    """Import -> export -> import gives bit-identical tensors (the mapping is a permutation)."""
    _, path, _ = hf_model
    cfg, tensors = hf_to_paratron(path)
    paratron_to_hf(cfg, tensors, tmp_path / "out")
    cfg2, tensors2 = hf_to_paratron(tmp_path / "out")
    assert cfg2 == cfg
    assert tensors2.keys() == tensors.keys()
    for k in tensors:
        assert torch.equal(tensors[k], tensors2[k]), k
