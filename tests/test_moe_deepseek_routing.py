"""DeepSeek-V3 routing (fp32): sigmoid scores normalised over the chosen top-k times a routed
scaling factor, with the aux-free expert bias, group-limited routing, a shared expert and the
first layers dense (``model.first_k_dense_replace``); Megatron-Core's names for them; and a tiny
model of that kind trained for 3 AdamW steps at EP=2 and EP=2 x TP=2 against one process; the MoE
layer against transformers' own DeepseekV3MoE."""

from __future__ import annotations

import pytest
import torch

from paratron.config import Config, ConfigError, ModelConfig
from paratron.rules import validate
from paratron.config.aliases import megatron_overrides, moe_layer_pattern
from paratron.rules import build_config
from paratron.config.model_shape import check_moe, is_moe_layer
from paratron.models.gpt import build_model_chunks
from paratron.models.mlp import MLP
from paratron.models.moe.layer import MoELayer
from paratron.models.moe.router import TopKRouter
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

from helpers import assert_parity, train_for_parity

TOL = 1e-5


def _model(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=40,
                seq_length=8, make_vocab_size_divisible_by=8, normalization="rmsnorm",
                position_embedding_type="rope", activation="swiglu", add_bias_linear=False,
                tie_embeddings=False, num_experts=8, moe_top_k=4, moe_ffn_hidden_size=12,
                moe_router_score="sigmoid", moe_router_topk_scaling_factor=2.5,
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2,
                moe_router_num_groups=4, moe_router_group_topk=2, moe_shared_expert_ffn_hidden_size=24,
                first_k_dense_replace=1, moe_aux_loss_type="seq", moe_aux_loss_coeff=1e-2)
    base.update(kw)
    return ModelConfig(**base)


def test_sigmoid_scores_normalised_over_top_k_then_scaled():
    """probs = 2.5 * sigmoid(logit_e) / sum over the chosen e, the choice made on score + bias."""
    cfg = _model()
    router = TopKRouter(cfg, ParallelContext.single(), logical_name="r", seed=0, sequence_parallel=False)
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.3, 0.4, 8))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    out = router(x)
    scores = torch.sigmoid(x @ router.weight.t())
    chosen = scores.gather(1, out.indices)
    torch.testing.assert_close(out.probs, 2.5 * chosen / chosen.sum(-1, keepdim=True), rtol=1e-6, atol=1e-6)
    assert torch.equal(out.indices, router.choose(scores))
    # The bias moves the choice: without it another set of experts wins for some token.
    router.expert_bias.zero_()
    assert not torch.equal(router.choose(scores), out.indices)
    # No scaling factor: the normalised weights sum to 1.
    plain = TopKRouter(_model(moe_router_topk_scaling_factor=None), ParallelContext.single(), logical_name="r",
                       seed=0, sequence_parallel=False)
    torch.testing.assert_close(plain(x).probs.sum(-1), torch.ones(5))


def test_first_k_dense_replace_builds_dense_layers_first():
    cfg = _model(num_layers=4, first_k_dense_replace=2, moe_layer_freq=1)
    assert [is_moe_layer(cfg, i) for i in range(4)] == [False, False, True, True]
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
    kinds = [type(chunk.layers[str(i)].mlp) for i in range(4)]
    assert kinds == [MLP, MLP, MoELayer, MoELayer]
    assert chunk.layers["0"].mlp.fc1.weight.shape[0] == 2 * 32  # the dense width, not the expert's
    # With moe_layer_freq the rule of DeepSeek's port: i >= first_k and i % freq == 0.
    cfg = _model(num_layers=6, first_k_dense_replace=1, moe_layer_freq=2)
    assert [i for i in range(6) if is_moe_layer(cfg, i)] == [2, 4]


@pytest.mark.parametrize("fields, message", [
    (dict(first_k_dense_replace=3), "first_k_dense_replace=3 with model.num_layers=2"),
    (dict(first_k_dense_replace=2), "leaves no MoE layer"),
    (dict(first_k_dense_replace=-1), "must be >= 0"),
    (dict(num_experts=0, first_k_dense_replace=1), "model.num_experts=0"),
    (dict(moe_router_topk_scaling_factor=0.0), "moe_router_topk_scaling_factor=0.0 must be > 0"),
])
def test_bad_routing_configs_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        check_moe(_model(**fields), tp=1, ep=1, expert_tp=1)
    cfg = Config()
    cfg.model = _model(**fields)
    with pytest.raises(ConfigError, match=message):  # the same rule, before launch
        validate(cfg, 1)


def test_megatron_names_and_flags():
    """Megatron-Core's config names as keys, its flags as aliases, and its per-layer MoE list."""
    cfg = build_config(None, ["model.moe_router_score_function=sigmoid", "model.moe_router_topk=3",
                              "model.moe_shared_expert_intermediate_size=64"])
    m = cfg.model
    assert (m.moe_router_score, m.moe_top_k, m.moe_shared_expert_ffn_hidden_size) == ("sigmoid", 3, 64)
    argv = ["--num-layers", "4", "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor",
            "2.5", "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-shared-expert-intermediate-size", "48",
            "--moe-router-enable-expert-bias", "--qk-layernorm", "--kv-channels", "8"]
    overrides, rest = megatron_overrides(argv)
    assert rest == []
    m = build_config(None, overrides).model
    assert (m.moe_router_score, m.moe_router_topk_scaling_factor, m.first_k_dense_replace, m.moe_layer_freq,
            m.moe_shared_expert_ffn_hidden_size, m.moe_router_enable_expert_bias, m.qk_layernorm,
            m.kv_channels) == ("sigmoid", 2.5, 1, 1, 48, True, True, 8)
    assert moe_layer_pattern("[1, 0, 1, 0]", 4) == (0, 2)
    assert moe_layer_pattern("[0]*3 + [1]*2", 5) == (3, 1)
    assert moe_layer_pattern("[0]*2 + [1, 0]*2", 6) == (1, 2)  # MoE at 2 and 4: i >= 1, i % 2 == 0
    with pytest.raises(ConfigError, match="not of that form"):
        moe_layer_pattern("[1, 1, 0, 1]", 4)
    with pytest.raises(ConfigError, match="not of that form"):
        moe_layer_pattern("[0]*3 + [1, 0]*2", 7)  # MoE at 3 and 5: odd layers
    with pytest.raises(ConfigError, match="one 0 or 1 per layer"):
        moe_layer_pattern("[0]*1+[1]*3", 5)
    with pytest.raises(ConfigError, match="expected an integer or a list"):
        moe_layer_pattern("__import__('os')", 4)


def _config(tp=1, ep=1, sp=False, pp=1, world=1) -> Config:
    cfg = Config()
    cfg.model = _model()
    p, t, o = cfg.parallel, cfg.train, cfg.optimizer
    p.tensor, p.expert, p.sequence_parallel, p.pipeline, p.bucket_size_mb = tp, ep, sp, pp, 0.001
    t.micro_batch_size, t.global_batch_size, t.seed = 1, 4, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 1.0, "constant"
    return validate(cfg, world)


def _rank(kw, world):
    cfg = _config(world=world, **kw)
    p = cfg.parallel
    return train_for_parity(cfg, ParallelContext.build(tp=p.tensor, ep=p.expert, pp=p.pipeline), steps=3)


LAYOUTS = {"ep2": (2, dict(ep=2)), "ep2-tp2-sp": (4, dict(ep=2, tp=2, sp=True)), "ep2-tp2": (4, dict(ep=2, tp=2)),
           # Stage 0 holds only the dense layer 0: its EP ranks have no expert or router.
           "ep2-pp2": (4, dict(ep=2, pp=2))}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_routed_moe_parity(name):
    """Sigmoid routing with bias, groups, scaling, a shared expert and layer 0 dense: 3 AdamW steps
    (clipping, weight decay) at EP=2 / EP=2 x TP=2 (SP on and off) match one process to 1e-5, the expert
    biases (moved by the global load each step) included."""
    world, kw = LAYOUTS[name]
    results = run_ranks(_rank, world, kw, world, timeout=300)
    ref = train_for_parity(_config(), ParallelContext.single(), steps=3)
    bias = ref["params"]["layers.1.mlp.router.expert_bias"][0]
    assert bias.abs().sum() > 0  # the aux-free bias moved
    assert "layers.0.mlp.fc1.weight" in ref["params"] and "layers.1.mlp.shared_expert.fc1.weight" in ref["params"]
    assert_parity(results, ref, TOL, name)


def test_moe_layer_computes_transformers_deepseek_v3_moe():
    """The whole MoE MLP (sigmoid gate with the score-correction bias, group-limited top-k,
    normalised and scaled weights, experts, shared experts) against transformers' own
    ``DeepseekV3MoE`` with the same weights, to 1e-5."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from paratron.parallel.params import load_full_

    hf_cfg = transformers.DeepseekV3Config(hidden_size=16, moe_intermediate_size=12, n_routed_experts=8,
                                           n_shared_experts=2, num_experts_per_tok=4, n_group=4, topk_group=2,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    torch.manual_seed(0)
    hf = DeepseekV3MoE(hf_cfg).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for t in list(hf.parameters()) + [hf.gate.e_score_correction_bias]:
            t.copy_(0.3 * torch.randn(t.shape, generator=g))
    cfg = _model(moe_shared_expert_ffn_hidden_size=24, first_k_dense_replace=0)
    layer = MoELayer(cfg, ParallelContext.single(), layer_number=0, seed=0, sequence_parallel=False).eval()
    full = {"router.weight": hf.gate.weight, "router.expert_bias": hf.gate.e_score_correction_bias,
            "shared_expert.fc1.weight": torch.cat([hf.shared_experts.gate_proj.weight, hf.shared_experts.up_proj.weight]),
            "shared_expert.fc2.weight": hf.shared_experts.down_proj.weight}
    for e in range(8):
        gate, up = hf.experts.gate_up_proj[e].chunk(2)
        full.update({f"experts.{e}.gate.weight": gate, f"experts.{e}.up.weight": up,
                     f"experts.{e}.fc2.weight": hf.experts.down_proj[e]})
    params = {p.meta.logical_name.removeprefix("layers.0.mlp."): p for p in layer.parameters()}
    assert params.keys() == full.keys()
    for name, p in params.items():
        load_full_(p, full[name].detach())
    x = torch.randn(6, 2, 16, generator=g)
    with torch.no_grad():
        want = hf(x.transpose(0, 1).contiguous()).transpose(0, 1)
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_planner_counts_the_parameters_of_such_a_model():
    """The planner's parameter count (shared experts, dense first layers, QK-norm included) is
    the built model's."""
    from paratron.planner.shape import Shape

    cfg = _model(num_layers=3, qk_layernorm=True, kv_channels=12)
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=0)
    built = sum(p.numel() for p in chunk.parameters() if p.requires_grad)
    assert Shape.of(cfg, cfg.seq_length).total_params() == built
