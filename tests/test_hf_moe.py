"""Hugging Face MoE conversion: tiny random Mixtral and Qwen2-MoE models built from transformers'
own config classes (no downloads), imported into paratron and exported back; logits match
transformers to 1e-5 (fp32) both ways, and the converted Mixtral trains at EP=2 exactly like one
process (losses to 1e-5 over 2 SGD steps). DeepSeek (MLA) is refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paratron.checkpoint.hf import hf_to_paratron, paratron_to_hf  # noqa: E402
from paratron.config import Config, ConfigError
from paratron.rules import validate  # noqa: E402
from paratron.models.gpt import build_model_chunks, full_logits, load_full_state  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402
from test_hf_parity import _perturb_  # noqa: E402  (randomised norms and biases)

TOL = 1e-5
VOCAB, SEQ, BATCH = 97, 12, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=2)


def _make(kind: str, path):
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, **COMMON)
        cls = transformers.MixtralForCausalLM
    else:  # norm_topk_prob false (raw top-k probabilities), Q/K/V biases, a gated shared expert
        cfg = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                          shared_expert_intermediate_size=40, norm_topk_prob=False, **COMMON)
        cls = transformers.Qwen2MoeForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    _perturb_(model, 1)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def hf_moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _make(request.param, path)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def _paratron_logits(cfg, tensors, ids, ctx) -> torch.Tensor:
    chunks = build_model_chunks(cfg, ctx, seed=0)
    load_full_state(chunks, tensors)
    (model,) = chunks
    with torch.no_grad():
        return full_logits(model.eval()(ids), ctx, cfg.vocab_size)


def assert_round_trip(model, path, out, check=lambda cfg, tensors: None) -> None:
    """``path`` (saved from ``model``) imports to logits within TOL of transformers'; its export
    to ``out`` loads back in transformers as the same class with those logits, and imports again
    to the same config and tensors. ``check(cfg, tensors)`` looks at the import first."""
    ids = _ids()
    ref = _hf_logits(model, ids)
    cfg, tensors = hf_to_paratron(path)
    check(cfg, tensors)
    ours = _paratron_logits(cfg, tensors, ids, ParallelContext.single())
    assert (ours - ref).abs().max().item() < TOL
    paratron_to_hf(cfg, tensors, out)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(model)
    assert (_hf_logits(reloaded, ids) - ref).abs().max().item() < TOL
    cfg2, tensors2 = hf_to_paratron(out)
    assert cfg2 == cfg and tensors2.keys() == tensors.keys()
    assert all(torch.equal(tensors[k], tensors2[k]) for k in tensors)


def test_moe_logits_match_and_round_trip(hf_moe, tmp_path):
    kind, path, model = hf_moe

    def check(cfg, tensors):
        assert cfg.num_experts == 4 and (cfg.moe_shared_expert_gate == (kind == "qwen2_moe"))

    assert_round_trip(model, path, tmp_path / "out", check)


def _ep_rank(path, ids):
    cfg, tensors = hf_to_paratron(path)
    return _paratron_logits(cfg, tensors, ids, ParallelContext.build(ep=2))


def test_moe_logits_at_ep2(hf_moe):
    _, path, model = hf_moe
    ids = _ids()
    ref = _hf_logits(model, ids)
    for ours in run_ranks(_ep_rank, 2, str(path), ids, timeout=240):
        assert (ours - ref).abs().max().item() < TOL


def _train_converted(path, ep: int) -> list[float]:
    from paratron.checkpoint.items import iter_params
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    model_cfg, tensors = hf_to_paratron(path)
    cfg = Config()
    cfg.model = model_cfg
    cfg.model.seq_length = SEQ
    cfg.parallel.expert = ep
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 4
    cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.optimizer.clip_grad = "sgd", 0.5, 0.0, 0.0
    cfg = validate(cfg, ep)
    ctx = ParallelContext.build(ep=ep) if ep > 1 else ParallelContext.single()
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    load_full_state(chunks, tensors)
    optimizer.copy_params_into_main(iter_params(chunks))
    rows = 4 // ctx.dp.size
    losses = []
    for step in range(2):
        # The same batch each step, so the loss must fall.
        ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))
        mine = ids[ctx.dp.rank * rows:(ctx.dp.rank + 1) * rows]
        mbs = [{"tokens": mine[i:i + 1, :-1], "labels": mine[i:i + 1, 1:]} for i in range(rows)]
        optimizer.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, loss_scale=1.0, ddp=ddp)
        optimizer.step()
        losses.append(out.read()["loss"])
    return losses


def test_converted_mixtral_trains_at_ep2(tmp_path):
    _make("mixtral", tmp_path)
    want = _train_converted(str(tmp_path), 1)
    assert want[1] < want[0]
    for got in run_ranks(_train_converted, 2, str(tmp_path), 2, timeout=240):
        assert got == pytest.approx(want, abs=TOL)


def test_deepseek_and_unsupported_moe_features_are_refused(tmp_path):
    from paratron.checkpoint.hf import hf_config_to_model

    ds = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "kv_lora_rank": 512}
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        hf_config_to_model(ds)
    mix = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, sliding_window=16, **COMMON).to_dict()
    mix["architectures"] = ["MixtralForCausalLM"]
    with pytest.raises(ConfigError, match="sliding_window"):
        hf_config_to_model(json.loads(json.dumps(mix)))
    cfg = hf_config_to_model({**mix, "sliding_window": None})
    from dataclasses import replace
    with pytest.raises(ConfigError, match="moe_router_score"):
        paratron_to_hf(replace(cfg, moe_router_score="sigmoid"), {}, tmp_path / "x")


def test_convert_cli_moe_both_ways(hf_moe, tmp_path, capsys):
    """``paratron convert`` through a paratron checkpoint and back: the same tensors, and the CLI
    names the family."""
    from paratron.checkpoint.io import load_model_full
    from paratron.cli import main

    kind, path, model = hf_moe
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf-out"
    assert main(["convert", "hf-to-paratron", str(path), str(ckpt)]) == 0
    assert main(["convert", "paratron-to-hf", str(ckpt), str(out)]) == 0
    assert {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[kind] in capsys.readouterr().out
    _, saved = load_model_full(ckpt)
    _, direct = hf_to_paratron(out)
    assert saved.keys() == direct.keys() and all(torch.equal(saved[k], direct[k]) for k in direct)
