"""Multi-head latent attention and multi-token prediction (paratron/models/mla.py, mtp.py)
against one process: a tiny dense Llama-style model with MLA (query and KV compression,
decoupled RoPE, v_head_dim != q/k head) and 2 MTP modules, trained 3 AdamW steps through the
real stack (model chunks, DDP, the pipeline runtime, the training step, the data loader's CP
split and MTP targets) on 2 ranks at TP=2+SP, CP=2 ring, CP=2 all2all, PP=2 (1F1B; tied and
untied embeddings, the MTP embedding copy kept in sync with stage 0's), CP=2 ring with packed
documents, recompute (full, selective), ZeRO-3 at DP=2 (MLA without MTP, and the
DeepSeek-V3-style model with MTP: the MTP modules gather with the head), PP=2 under DualPipeV
(4 layers on 4 V-placed stages, dense and DeepSeek-V3-style), and the DeepSeek-V3-style model at EP=2 (MLA + MTP + one dense layer first, then
sigmoid-routed MoE layers with the aux-free bias, group-limited top-k, the routed scaling factor
and a shared expert; the MTP layers are MoE too). Losses (LM and MTP), grad norms and params match one
process to 1e-5 (fp32). Also: MTP under PP=2 gives the MTP loss and every grad of PP=1, a
lambda = 0 run is bitwise the same as one without MTP, and the bad configs are named.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from paratron.config import Config, ConfigError
from paratron.rules import validate
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

GBS, SEQ, VOCAB, STEPS = 4, 16, 32, 3


def _config(*, cp=1, algorithm="ring", tp=1, sp=False, pp=1, recompute="none", mtp=2, lam=0.3, tie=False,
            packed=False, moe=False, ep=1, zero=0, world=1, schedule="1f1b", layers=2) -> Config:
    cfg = Config()
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    m.num_layers, m.vocab_size, m.seq_length, m.make_vocab_size_divisible_by = layers, VOCAB, SEQ, 8
    m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 32, 4, 48
    m.normalization, m.position_embedding_type, m.activation = "rmsnorm", "rope", "swiglu"
    m.add_bias_linear, m.tie_embeddings = False, tie
    m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank = True, 24, 16
    m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim = 8, 4, 6
    m.mtp_num_layers, m.mtp_loss_scaling_factor = mtp, lam
    m.recompute = recompute
    if moe:  # DeepSeek-V3-style: one dense layer first, then MoE layers with sigmoid scores scaled by 2.5,
        # the aux-free expert bias, 2 expert groups (1 chosen), a shared expert
        m.num_experts, m.moe_top_k, m.moe_ffn_hidden_size, m.moe_router_score = 4, 2, 16, "sigmoid"
        m.moe_router_enable_expert_bias, m.moe_shared_expert_ffn_hidden_size, m.moe_aux_loss_coeff = True, 16, 0.01
        m.first_k_dense_replace, m.moe_router_topk_scaling_factor = 1, 2.5
        m.moe_router_num_groups, m.moe_router_group_topk = 2, 1
    p.context, p.context_algorithm, p.tensor, p.sequence_parallel, p.pipeline = cp, algorithm, tp, sp, pp
    p.expert, p.zero, p.schedule = ep, zero, schedule
    p.virtual_pipeline = 2 if schedule == "dualpipev" else 1
    p.bucket_size_mb = 0.001
    cfg.data.reset_attention_mask = cfg.data.reset_position_ids = packed
    t.micro_batch_size, t.global_batch_size, t.seed = 1, GBS, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 1.0, "constant"
    o.adam_eps = 1e-5  # see tests/test_cp_parity.py: keeps round-off-sized grads from taking lr-sized steps
    return validate(cfg, world)


def _batch(step: int):
    g = torch.Generator().manual_seed(70 + step)
    tokens = torch.randint(1, VOCAB, (GBS, SEQ), generator=g)
    tokens[:, 5] = 0  # eod = 0: packed runs see two documents per row
    labels = torch.randint(0, VOCAB, (GBS, SEQ), generator=g)
    labels[torch.rand(GBS, SEQ, generator=g) < 0.2] = -100
    return tokens, labels


def _train(cfg: Config, ctx, steps: int = STEPS, grads: bool = False) -> dict:
    from paratron.training.data_iter import microbatch_preparer
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    torch.manual_seed(0)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    prepare = microbatch_preparer(cfg, ctx, eod=0)
    history, grad = [], {}
    rows = GBS // ctx.dp.size
    for step in range(steps):
        tokens, labels = (t[ctx.dp.rank * rows:(ctx.dp.rank + 1) * rows] for t in _batch(step))
        mbs = [prepare({"tokens": tokens[i:i + 1], "labels": labels[i:i + 1]}) for i in range(rows)]
        optimizer.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, loss_scale=optimizer.loss_scale, ddp=ddp)
        if grads and step == 0:
            grad = {p.meta.logical_name: (p.meta.shard.valid(p.grad if p.meta.main_grad is None else p.meta.main_grad)
                                          .detach().clone(), p.meta.shard.slices())
                    for c in chunks for p in c.parameters() if p.requires_grad}
        res = optimizer.step()
        history.append((out.loss, out.mtp_loss, res.grad_norm))
    with ddp.param_shards.gathered() if ddp.param_shards is not None else contextlib.nullcontext():
        params = {p.meta.logical_name: (p.meta.shard.valid(p).detach().clone(), p.meta.shard.slices())
                  for c in chunks for p in c.parameters()}
    return {"params": params, "history": history, "grads": grad}


LAYOUTS = [dict(tp=2, sp=True), dict(cp=2, algorithm="ring"), dict(cp=2, algorithm="all2all"), dict(pp=2),
           dict(moe=True, ep=2)]
MORE = [dict(pp=2, tie=True), dict(cp=2, algorithm="ring", packed=True), dict(tp=2, recompute="full"),
        dict(cp=2, algorithm="all2all", recompute="selective"), dict(zero=3, mtp=0)] + [
    dict(kw, moe=True) for kw in (dict(tp=2, sp=True), dict(cp=2, algorithm="ring"), dict(cp=2, algorithm="all2all"),
                                  dict(pp=2))]


def _rank(layouts, world=2):
    outs = []
    for kw in layouts:
        cfg = _config(world=world, **kw)
        p = cfg.parallel
        ctx = ParallelContext.build(tp=p.tensor, cp=p.context, pp=p.pipeline, ep=p.expert)
        outs.append(_train(cfg, ctx, grads=kw.get("pp", 1) > 1))
    return outs


def _close(a, b, what):
    assert a == (None if b is None else pytest.approx(b, rel=1e-5)), f"{what}: {a} vs {b}"


def _check(layouts, world=2):
    results = run_ranks(_rank, world, layouts, world, timeout=900)
    refs = {}
    for i, kw in enumerate(layouts):
        key = (kw.get("tie", False), kw.get("packed", False), kw.get("moe", False), kw.get("mtp", 2),
               kw.get("layers", 2))
        if key not in refs:
            refs[key] = _train(_config(tie=key[0], packed=key[1], moe=key[2], mtp=key[3], layers=key[4]),
                               ParallelContext.single(), grads=True)
        ref, seen = refs[key], set()
        for rank_out in results:
            res = rank_out[i]
            for got, want in zip(res["history"], ref["history"]):
                for name, a, b in zip(("loss", "mtp_loss", "grad_norm"), got, want):
                    _close(a, b, f"{kw} {name}")
            for n, (p, slices) in res["params"].items():
                torch.testing.assert_close(p, ref["params"][n][0][slices], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{kw} param {n}: {m}")
                seen.add(n)
            for n, (g, slices) in res["grads"].items():
                torch.testing.assert_close(g, ref["grads"][n][0][slices], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{kw} grad {n}: {m}")
        assert seen == set(ref["params"]), kw
    return refs


def test_mla_mtp_parity_world2():
    """TP=2+SP, CP=2 ring / all2all, PP=2 (1F1B), and the MoE model at EP=2: 3 AdamW steps of
    MLA + 2 MTP modules match one process to 1e-5 (LM loss, MTP loss, grad norm, every param);
    under PP the first step's grads (main and MTP modules, and the shared embedding) match PP=1."""
    refs = _check(LAYOUTS)
    assert any(n.startswith(f"layers.{2 + 1}.eh_proj") for n in refs[(False, False, False, 2, 2)]["params"])


@pytest.mark.slow
def test_mla_mtp_more_compositions_world2():
    """PP=2 with tied embeddings (the MTP lookup uses the last stage's tied copy), packed
    documents under CP=2 ring, full recompute at TP=2, selective recompute under CP=2 all2all,
    MLA under ZeRO-3 at DP=2, and the DeepSeek-V3-style MoE model at TP=2+SP, CP=2 ring and
    all2all, PP=2: parity to 1e-5 as above."""
    _check(MORE)


@pytest.mark.slow
def test_deepseek_style_ep2_tp2_pp2_world8():
    """The DeepSeek-V3-style model (MLA + MTP + one dense layer, then sigmoid-routed MoE) at
    EP=2 x TP=2+SP x PP=2 on 8 ranks: parity to 1e-5."""
    _check([dict(moe=True, ep=2, tp=2, sp=True, pp=2)], world=8)


def test_dualpipev_and_zero3_mtp_world2():
    """PP=2 under DualPipeV (two V-placed stages per rank, FB pairs, deferred weight grads; the
    last stage's MTP modules share rank 0's embedding) for the dense MLA + MTP model and the
    DeepSeek-V3-style MoE model, and that MoE model under ZeRO-3 at DP=2 (MTP modules and their
    embedding gathered with the head unit): 3 AdamW steps match one process to 1e-5."""
    _check([dict(pp=2, schedule="dualpipev", layers=4), dict(pp=2, schedule="dualpipev", layers=4, moe=True),
            dict(moe=True, zero=3)])


def test_mtp_lambda_zero_is_bitwise_no_mtp():
    """lambda = 0: the MTP modules run (their loss is logged) but the LM loss and every main
    param after 3 steps are bitwise those of the same model without MTP."""
    with_mtp = _train(_config(mtp=2, lam=0.0), ParallelContext.single())
    without = _train(_config(mtp=0), ParallelContext.single())
    assert [h[0] for h in with_mtp["history"]] == [h[0] for h in without["history"]]
    assert all(h[1] is not None and h[1] > 0 for h in with_mtp["history"])
    assert without["history"][0][1] is None
    for n, (p, _) in without["params"].items():
        assert torch.equal(p, with_mtp["params"][n][0]), n


def test_mtp_targets_shift_and_documents():
    """Module k sees token i+k and predicts label i+k; targets past the row or in another
    document are ignored."""
    from paratron.models.mtp import add_mtp_targets

    tokens = torch.arange(10, 18).reshape(1, 8)
    labels = torch.arange(11, 19).reshape(1, 8)
    out = add_mtp_targets({"tokens": tokens, "labels": labels}, 2)
    assert out["mtp_tokens"][0, :, 1].tolist() == [12, 13, 14, 15, 16, 17, 0, 0]
    assert out["mtp_labels"][0, :, 0].tolist() == [12, 13, 14, 15, 16, 17, 18, -100]
    packed = add_mtp_targets({"tokens": tokens, "labels": labels, "cu_seqlens": torch.tensor([[0, 4, 8]])}, 1)
    assert packed["mtp_labels"][0].flatten().tolist() == [12, 13, 14, -100, 16, 17, 18, -100]


@pytest.mark.parametrize("field, value, world, message", [
    ("model.kv_lora_rank", 64, 1, "model.kv_lora_rank=64 must be in [1, model.hidden_size=32]"),
    ("model.q_lora_rank", 33, 1, "model.q_lora_rank=33"),
    ("parallel.tensor", 8, 8, "model.num_attention_heads=4 is not divisible by parallel.tensor=8"),
    ("model.mtp_num_layers", SEQ, 1, f"model.mtp_num_layers={SEQ} must be in [0, model.seq_length-1"),
    ("parallel.pipeline_layout", [1, 1], 2, "leaves the last stage no room"),
    ("model.kv_channels", 16, 1, "model.kv_channels=16 with model.multi_latent_attention=true"),
])
def test_bad_configs_named(field, value, world, message):
    cfg = _config()
    section, name = field.split(".")
    setattr(getattr(cfg, section), name, value)
    if name == "pipeline_layout":
        cfg.parallel.pipeline = 2
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("+", r"\+")):
        validate(cfg, world)


def _train_in_rank(argv):
    from paratron.cli import main

    return main(argv)


def test_the_tiny_deepseek_v3_run_config_validates_and_trains(tiny_corpus, tmp_path):
    """``configs/deepseek-v3-tiny.toml`` as shipped (MLA, MTP, a dense first layer, then
    sigmoid-routed MoE layers with groups, a shared expert and the expert bias, at EP=2) passes
    the config rules, and ``paratron train`` runs 2 steps of it on 2 ranks (the tiny corpus in
    place of its Shakespeare one), logging the MTP loss beside the LM loss."""
    import json
    from pathlib import Path

    from paratron.config.model_shape import is_moe_layer
    from paratron.rules import load_config

    config = Path(__file__).resolve().parents[1] / "configs" / "deepseek-v3-tiny.toml"
    cfg = load_config(config)
    cfg.model.vocab_size = 2048
    validate(cfg, 2)
    m = cfg.model
    assert m.multi_latent_attention and m.q_lora_rank and m.mtp_num_layers == 1 and m.moe_router_score == "sigmoid"
    assert [is_moe_layer(m, i) for i in range(m.num_layers)] == [False, True, True]
    argv = ["train", "--config", str(config), "--run-dir", str(tmp_path / "run")]
    for o in tiny_corpus + ["data.split=90,10,0", "train.train_iters=2", "train.eval_iters=1",
                            "train.sample_tokens=0", "logging.tensorboard=false"]:
        argv += ["--set", o]
    assert run_ranks(_train_in_rank, 2, argv, timeout=300) == [0, 0]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2] and all(r["mtp_loss"] > 0 for r in steps)
