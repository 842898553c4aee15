"""Hugging Face Qwen3 and Qwen3-MoE conversion both ways (fp32): tiny random models built from
transformers' own config classes (no downloads; a head_dim apart from hidden/heads, QK-norm,
Qwen3-MoE with its first layer dense and renormalised top-k), imported into paratron and exported
back; logits match transformers to 1e-5 on one process, at TP=2 (dense) and EP=2 (MoE), and the
converted Qwen3-MoE trains at EP=2 as on one process;
``paratron plan --hf-config`` takes their config.json; what paratron cannot model is named."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.hf import hf_config_to_model, hf_to_paratron, paratron_to_hf  # noqa: E402
from paratron.config import ConfigError  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402
from test_hf_moe import TOL, VOCAB, _hf_logits, _ids, _paratron_logits, _train_converted, assert_round_trip  # noqa: E402,E501
from test_hf_parity import _perturb_  # noqa: E402  (randomised norms, QK-norm weights included)

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def _hf_config(kind: str):
    if kind == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, **COMMON), transformers.Qwen3ForCausalLM
    # Layer 0 dense (mlp_only_layers), layers 1-2 MoE with 4 experts, top-2 renormalised.
    cfg = transformers.Qwen3MoeConfig(num_hidden_layers=3, moe_intermediate_size=24, num_experts=4,
                                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], **COMMON)
    return cfg, transformers.Qwen3MoeForCausalLM


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def hf_qwen3(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    cfg, cls = _hf_config(request.param)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    _perturb_(model, 1)
    model.save_pretrained(path, safe_serialization=True)
    return request.param, path, model


def test_qwen3_logits_match_and_round_trip(hf_qwen3, tmp_path):
    kind, path, model = hf_qwen3

    def check(cfg, tensors):
        assert cfg.qk_layernorm and cfg.kv_channels == 16 and not cfg.add_bias_linear
        assert tensors["layers.1.attention.q_norm.weight"].shape == (16,)
        if kind == "qwen3_moe":
            assert (cfg.num_experts, cfg.first_k_dense_replace, cfg.moe_router_norm_topk_prob) == (4, 1, True)
            assert "layers.0.mlp.fc1.weight" in tensors and "layers.1.mlp.experts.3.fc2.weight" in tensors

    assert_round_trip(model, path, tmp_path / "out", check)


def _parallel_rank(path, ids, kind):
    cfg, tensors = hf_to_paratron(path)
    ctx = ParallelContext.build(tp=2) if kind == "qwen3" else ParallelContext.build(ep=2)
    return _paratron_logits(cfg, tensors, ids, ctx)


def test_qwen3_logits_at_tp2_and_ep2(hf_qwen3):
    kind, path, model = hf_qwen3
    ids = _ids()
    ref = _hf_logits(model, ids)
    for ours in run_ranks(_parallel_rank, 2, str(path), ids, kind, timeout=240):
        assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("hf_qwen3", ["qwen3_moe"], indirect=True)
def test_converted_qwen3_moe_trains_at_ep2(hf_qwen3):
    """The imported Qwen3-MoE (QK-norm, dense layer 0) trains 2 SGD steps at EP=2 exactly like one process."""
    _, path, _ = hf_qwen3
    want = _train_converted(str(path), 1)
    assert want[1] < want[0]
    for got in run_ranks(_train_converted, 2, str(path), 2, timeout=240):
        assert got == pytest.approx(want, abs=TOL)


def test_plan_takes_their_config_json(hf_qwen3, capsys):
    from paratron.cli import main

    kind, path, _ = hf_qwen3
    argv = ["plan", "--hf-config", str(path / "config.json"), "--gpu", "h100", "--gpus-per-node", "2",
            "--top-k", "1", "--global-batch-size", "8", "--seq-length", "32"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "layouts accepted by the validator" in capsys.readouterr().out


def test_what_paratron_cannot_model_is_named(tmp_path):
    cfg, _ = _hf_config("qwen3")
    dense = {**cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ConfigError, match="sliding-window attention"):
        hf_config_to_model({**dense, "use_sliding_window": True})
    moe_cfg, _ = _hf_config("qwen3_moe")
    moe = json.loads(json.dumps({**moe_cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"mlp_only_layers=\[2\], decoder_sparse_step=1 make layers \[0, 1\] MoE"):
        hf_config_to_model({**moe, "mlp_only_layers": [2]})
    every_other = hf_config_to_model({**moe, "mlp_only_layers": [1]})  # MoE at 0 and 2
    assert (every_other.first_k_dense_replace, every_other.moe_layer_freq) == (0, 2)
    assert hf_config_to_model({**moe, "mlp_only_layers": [], "decoder_sparse_step": 1}).first_k_dense_replace == 0
    model = hf_config_to_model(moe)
    with pytest.raises(ConfigError, match="no shared expert"):
        paratron_to_hf(replace(model, moe_shared_expert_ffn_hidden_size=16), {}, tmp_path / "x")
    with pytest.raises(ConfigError, match="moe_router_score='sigmoid'"):
        paratron_to_hf(replace(model, moe_router_score="sigmoid"), {}, tmp_path / "x")


def test_qk_norm_of_the_wrong_width_is_named(hf_qwen3, tmp_path):
    from safetensors.torch import load_file, save_file

    kind, path, _ = hf_qwen3
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_norm.weight"] = torch.ones(8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_norm.weight has shape \(8,\).*\(16,\)"):
        hf_to_paratron(tmp_path)


def test_llama_with_an_explicit_head_dim_round_trips(tmp_path):
    """Llama's ``head_dim`` apart from hidden/heads is model.kv_channels too (it used to be refused)."""
    cfg = transformers.LlamaConfig(num_hidden_layers=1, attention_bias=False, mlp_bias=False, **COMMON)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    _perturb_(model, 2)
    model.save_pretrained(tmp_path / "llama", safe_serialization=True)

    def check(cfg, tensors):
        assert cfg.kv_channels == 16 and not cfg.qk_layernorm

    assert_round_trip(model, tmp_path / "llama", tmp_path / "out", check)
