"""Muon (paratron.optim.muon) and low-precision optimizer state.

* Newton-Schulz against an SVD-based orthogonalisation on random matrices;
* Muon with AdamW for embeddings, head, norms and biases at TP2 x DP2 with ZeRO-1, PP2 x DP2 and
  PP2 x DP2 with ZeRO-3, on a Llama-style GPT (GQA fused QKV, SwiGLU's strided [gate; up], biases,
  untied head), against one process stepping the same model with ``torch.optim.AdamW`` and a plain
  per-matrix Muon written here (1e-5 over 3 steps);
* a Muon checkpoint saved at TP2 x DP2 resumes bitwise at TP2 x DP2 and within 1e-6 at DP4;
* bf16 moments against fp32 moments over 20 steps (1e-3), at half the state bytes.
"""

from __future__ import annotations

import math

import pytest
import torch

from paratron.config import ModelConfig, OptimizerConfig
from paratron.models.gpt import build_model_chunks, gather_full_state
from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads
from paratron.optim.muon import NS_COEFFICIENTS, newton_schulz, scale_factor, uses_muon
from paratron.parallel.context import ParallelContext
from paratron.pipeline.partition import stage_layers
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.runtime import run_pipeline
from paratron.local_ranks import run_ranks

from helpers import perturb_1d_params_
from test_optim_parallel import GLOBAL_B, IGNORE, SEQ, VOCAB, _batch

HID, LAYERS, SEED = 16, 4, 5
HEADS, GROUPS, FFN = 4, 2, 24
STEPS, CLIP = 3, 0.05


def _cfg() -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=HID, num_attention_heads=HEADS, num_query_groups=GROUPS,
                       ffn_hidden_size=FFN, vocab_size=VOCAB, seq_length=SEQ, make_vocab_size_divisible_by=4,
                       activation="swiglu", add_bias_linear=True, tie_embeddings=False)


def _opt(**kw) -> OptimizerConfig:
    return OptimizerConfig(**{**dict(name="muon", lr=2e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                                     adam_eps=1e-6, clip_grad=CLIP), **kw})


# ---- Newton-Schulz --------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (48, 48), (8, 200)])
def test_newton_schulz_against_svd(shape):
    """On random matrices of condition number 20, NS5 has the singular vectors of the SVD-based
    polar factor ``U V^T``: in the SVD basis its matrix is diagonal (off-diagonal below 1e-4 of the
    largest entry), with singular values in the quintic's published band (Jordan: roughly
    0.7-1.2; the quintic maps [0.68, 1.2] into itself, and lifts every normalised singular value
    above 0.005 into it within 5 steps); so it is within 0.32 of ``U V^T`` in spectral norm."""
    g = torch.Generator().manual_seed(sum(shape))
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -math.log10(20), k, dtype=torch.float64)  # condition number 20
    m = (u * s) @ v.T
    assert s.min() / s.norm() > 0.005
    o = newton_schulz(m.float()).double()
    assert o.shape == m.shape and newton_schulz(m.float()).dtype == torch.float32
    polar = u @ v.T  # the exact orthogonalisation, from the SVD the matrix was built with
    inner = u.T @ o @ v  # NS5 in the SVD basis
    diag = torch.diagonal(inner)
    off = inner - torch.diag(diag)
    assert off.abs().max() < 1e-4 * diag.abs().max()
    assert diag.min() > 0.68 and diag.max() < 1.21, (diag.min(), diag.max())
    sv = torch.linalg.svdvals(o)
    assert sv.min() > 0.68 and sv.max() < 1.21
    assert torch.linalg.matrix_norm(o - polar, 2) < 0.32
    assert NS_COEFFICIENTS == (3.4445, -4.7750, 2.0315)


def test_scale_modes_and_param_rule():
    """Megatron-Core's scale modes; Muon steps the 2-D hidden weights only."""
    assert scale_factor(64, 16, "spectral") == pytest.approx(8.0)
    assert scale_factor(64, 16, "spectral", 0.2) == pytest.approx(1.6)
    assert scale_factor(16, 64, "unit_rms_norm") == pytest.approx(0.5)
    assert scale_factor(16, 64, "shape_scaling") == pytest.approx(1.0)
    assert scale_factor(64, 16, "shape_scaling") == pytest.approx(2.0)
    with pytest.raises(ValueError, match="muon_scale_mode"):
        scale_factor(4, 4, "bogus")
    (model,) = build_model_chunks(_cfg(), ParallelContext.single(), seed=SEED)
    muon = {p.meta.logical_name for p in model.parameters() if uses_muon(p)}
    assert muon == {f"layers.{i}.{n}.weight" for i in range(LAYERS)
                    for n in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")}


# ---- the one-process reference ----------------------------------------------------------------

def _logical(name: str, t: torch.Tensor) -> list[torch.Tensor]:
    """The logical matrices of a full weight of this model, written out here from the layout
    (QKV grouped per KV group, SwiGLU's fc1 = [gate; up])."""
    d = HID // HEADS
    if name.endswith("qkv.weight"):
        q = HEADS // GROUPS * d
        return list(t.view(GROUPS, q + 2 * d, HID).split([q, d, d], dim=1))
    if name.endswith("fc1.weight"):
        return list(t.chunk(2, dim=0))
    return [t]


def _reference_muon_step(p, buf, cfg) -> None:
    g = p.grad
    buf.lerp_(g, 1 - cfg.muon_momentum)
    u = g.lerp(buf, cfg.muon_momentum)
    parts = _logical(p.meta.logical_name, u)
    outs = [newton_schulz(m.reshape(-1, m.shape[-1])).view(m.shape)
            * 0.2 * math.sqrt(max(m.reshape(-1, m.shape[-1]).shape)) for m in parts]
    o = torch.cat(outs, dim=1).view(u.shape) if p.meta.logical_name.endswith("qkv.weight") else torch.cat(outs)
    with torch.no_grad():
        p.mul_(1 - cfg.lr * cfg.weight_decay)
        p.add_(o, alpha=-cfg.lr)


def reference(batches) -> dict[str, torch.Tensor]:
    """One process, plain torch: AdamW for the embeddings, head, norms and biases; Muon as in the
    papers for the other matrices; global clipping over all params."""
    ctx = ParallelContext.single()
    (model,) = build_model_chunks(_cfg(), ctx, seed=SEED)
    perturb_1d_params_([model])
    cfg = _opt()
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() == 2 and not p.meta.logical_name.startswith(("embedding.", "output_layer."))]
    rest = [p for p in params if all(p is not m for m in matrices)]
    adam = torch.optim.AdamW([{"params": [p for p in rest if not p.meta.no_weight_decay]},
                              {"params": [p for p in rest if p.meta.no_weight_decay], "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)
    bufs = [torch.zeros_like(p) for p in matrices]
    for ids, labels in batches:
        for p in params:
            p.grad = None
        (model(ids, labels).sum() / (labels != IGNORE).sum()).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        adam.step()
        for p, buf in zip(matrices, bufs):
            _reference_muon_step(p, buf, cfg)
    return gather_full_state([model], ctx)


# ---- distributed runs ---------------------------------------------------------------------------

def train(ctx, *, zero: int, batches, m: int = 2, sp: bool = False, opt_kw=None):
    """This rank's part of the layout for len(batches) steps; returns the full params of its
    stage and the optimizer."""
    chunks = build_model_chunks(_cfg(), ctx, seed=SEED, stage_layers=stage_layers(LAYERS, ctx.pp.size, 1),
                                sequence_parallel=sp)
    perturb_1d_params_(chunks)
    # Small buckets: ZeRO shard boundaries fall inside the matrices.
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, zero=zero)
    opt = build_optimizer(chunks, ctx, _opt(**(opt_kw or {})), ddp)
    dp, r = ctx.dp.size, ctx.dp.rank
    rows = GLOBAL_B // dp
    mbs = rows // m
    for ids, labels in batches:
        total = (labels != IGNORE).sum()
        ids, labels = ids[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows]
        micro = [(ids[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(m)]

        def forward_step(chunk_id, chunk, x, mb):
            tok, lab = mb
            y = chunk(tok if x is None else x, lab if chunk.post_process else None)
            return y.sum() / total if chunk.post_process else y

        opt.zero_grad()
        seq = SEQ // ctx.tp.size if sp else SEQ
        run_pipeline(build_schedule("1f1b", ctx.pp.size, m, 1)[ctx.pp.rank], chunks, ctx, micro, forward_step,
                     (seq, mbs, HID), torch.float32, grad_sync=ddp)
        finalize_grads(chunks, ctx, ddp)
        assert not opt.step().skipped
    with ddp.full_params():
        return {k: t.float() for k, t in gather_full_state(chunks, ctx).items()}, opt


MUON_LAYOUTS = [dict(tp=2, pp=1, zero=1), dict(tp=1, pp=2, zero=0), dict(tp=1, pp=2, zero=3),
                dict(tp=2, pp=1, zero=3, sp=True)]


def _rank_layouts():
    out = []
    for lay in MUON_LAYOUTS:
        ctx = ParallelContext.build(tp=lay["tp"], pp=lay["pp"])
        full, opt = train(ctx, zero=lay["zero"], sp=lay.get("sp", False), batches=[_batch(s) for s in range(STEPS)])
        out.append(full)
    return out


def test_muon_layouts_match_one_process():
    """Muon at TP2 x DP2 with ZeRO-1, PP2 x DP2, PP2 x DP2 with ZeRO-3 and TP2+SP x DP2 with ZeRO-3
    (small buckets: ZeRO shards split the matrices) matches the one-process reference to 1e-5 after
    3 steps with clipping active; replicas are bitwise equal."""
    outs = run_ranks(_rank_layouts, 4, timeout=400)
    ref = reference([_batch(s) for s in range(STEPS)])
    for i, lay in enumerate(MUON_LAYOUTS):
        merged: dict[str, torch.Tensor] = {}
        for rank_out in outs:
            for name, t in rank_out[i].items():
                if name in merged:
                    assert torch.equal(merged[name], t), f"{lay}: {name} differs between ranks"
                merged[name] = t
        assert merged.keys() == ref.keys(), lay
        for name, t in ref.items():
            torch.testing.assert_close(merged[name], t, rtol=1e-5, atol=1e-5,
                                       msg=lambda msg: f"{lay}: {name}: {msg}")


def test_muon_single_process_matches_reference_and_moves_every_matrix():
    """The optimizer at one process against the reference (1e-5); the control: every Muon matrix
    moved from its init, so the comparison is not vacuous."""
    ctx = ParallelContext.single()
    batches = [_batch(s) for s in range(STEPS)]
    full, _ = train(ctx, zero=0, batches=batches)
    ref = reference(batches)
    (init,) = build_model_chunks(_cfg(), ctx, seed=SEED)
    for p in init.parameters():
        if uses_muon(p):
            assert not torch.allclose(full[p.meta.logical_name], p.detach(), atol=1e-3), p.meta.logical_name
    for name, t in ref.items():
        torch.testing.assert_close(full[name], t, rtol=1e-5, atol=1e-5, msg=lambda msg: f"{name}: {msg}")


# ---- low-precision moments -----------------------------------------------------------------------

def _moment_bytes(opt) -> int:
    st = opt.allocated_state()
    return sum(t.numel() * t.element_size() for k in ("exp_avg", "exp_avg_sq", "momentum") for t in st.get(k, []))


@pytest.mark.parametrize("name,tol", [("adamw", 1e-3), ("muon", 2e-3)])
def test_bf16_moments_match_fp32_over_20_steps(name, tol):
    """``exp_avg_dtype = exp_avg_sq_dtype = "bf16"``: the moments are stored in bf16 (half the
    bytes of fp32), and after 20 steps at lr 1e-3 the params match the fp32-moment run within
    1e-3 (AdamW). Muon's momentum follows ``exp_avg_dtype``; Newton-Schulz amplifies its rounding
    in the weak directions, so there the bound is 2e-3 (measured 1.03e-3), still under 10% of the
    distance the params moved."""
    ctx = ParallelContext.single()
    batches = [_batch(s % 5) for s in range(20)]
    full32, opt32 = train(ctx, zero=0, batches=batches, opt_kw=dict(name=name, lr=1e-3))
    full16, opt16 = train(ctx, zero=0, batches=batches,
                          opt_kw=dict(name=name, lr=1e-3, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"))
    kinds = [k for k in ("exp_avg", "exp_avg_sq", "momentum") if opt16.allocated_state().get(k)]
    assert all(t.dtype == torch.bfloat16 for k in kinds for t in opt16.allocated_state()[k])
    assert _moment_bytes(opt16) * 2 == _moment_bytes(opt32) > 0
    diff = max((full16[n] - full32[n]).abs().max().item() for n in full32)
    (init,) = build_model_chunks(_cfg(), ctx, seed=SEED)
    perturb_1d_params_([init])
    start = gather_full_state([init], ctx)
    moved = max((full32[n] - start[n]).abs().max().item() for n in full32)
    assert 0 < diff < tol and diff < 0.1 * moved, (diff, moved)


# ---- checkpoints ------------------------------------------------------------------------------------

def _muon_run(lay: dict):
    """Config, context and (chunks, ddp, optimizer, scheduler) of the checkpoint tests' tiny model
    (SwiGLU with biases, vocab 500) under ``lay``, with Muon."""
    from paratron.training.builders import build_model_and_optimizer
    from test_checkpoint_optim import train_config

    cfg = train_config(lay)
    cfg.optimizer.name = "muon"
    ctx = ParallelContext.build(tp=lay["tp"], pp=lay["pp"])
    return cfg, ctx, build_model_and_optimizer(cfg, ctx)


def _full_params(cfg, ctx, model) -> dict[str, torch.Tensor]:
    chunks, ddp, _, _ = model
    with ddp.full_params():
        return {k: t.clone() for k, t in gather_full_state(chunks, ctx).items()}


def _muon_save_and_resume(root):
    from paratron.checkpoint.io import load_tensors_full
    from paratron.checkpoint.manager import CheckpointManager
    from paratron.config import CheckpointConfig
    from test_checkpoint_optim import check_against_checkpoint, train_steps

    save_at, after = 2, range(3, 5)
    cfg, ctx, model = _muon_run(dict(tp=2, pp=1, v=1, zero=1))
    train_steps(cfg, ctx, model, range(1, save_at + 1))
    cfg.checkpoint.save = root
    chunks, _, opt, sched = model
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(save_at, chunks, opt, sched, {"iteration": save_at})
    out = {"reference": (train_steps(cfg, ctx, model, after), _full_params(cfg, ctx, model))}
    saved = load_tensors_full(root, "model/"), load_tensors_full(root, "optimizer/")
    out["momentum_keys"] = sorted(load_tensors_full(root, "optimizer/momentum/"))
    for name, lay in (("tp2", dict(tp=2, pp=1, v=1, zero=1)), ("dp4", dict(tp=1, pp=1, v=1, zero=1, mbs=2))):
        cfg_b, ctx_b, model_b = _muon_run(lay)
        chunks_b, _, opt_b, sched_b = model_b
        CheckpointManager(CheckpointConfig(load=root), ctx_b, cfg_b).load(chunks_b, opt_b, sched_b)
        checked = check_against_checkpoint(saved, model_b)
        out[name] = (checked, train_steps(cfg_b, ctx_b, model_b, after), _full_params(cfg_b, ctx_b, model_b))
    return out


@pytest.mark.slow
def test_muon_checkpoint_resumes_bitwise_at_tp2_and_at_dp4(tmp_path):
    """Save a Muon run at TP2 x DP2 with ZeRO-1 after 2 steps (its momentum under
    ``optimizer/momentum/<matrix>``, AdamW moments for the rest), resume at TP2 x DP2: the state
    loads bitwise and the next 2 steps' losses and params equal the uninterrupted run's bitwise;
    resume at DP4 with ZeRO-1 (the momentum resharded): losses within 1e-6."""
    results = run_ranks(_muon_save_and_resume, 4, str(tmp_path / "ck"), timeout=600)
    losses, params = results[0]["reference"]
    assert results[0]["momentum_keys"] and all(k.endswith(".weight") for k in results[0]["momentum_keys"])
    assert not any("embedding" in k or "output_layer" in k for k in results[0]["momentum_keys"])
    for rank, r in enumerate(results):
        checked, got, full = r["tp2"]
        assert checked > 0 and got == losses, (rank, got, losses)
        assert all(torch.equal(full[n], params[n]) for n in params), rank
        checked, got, _ = r["dp4"]
        assert checked > 0
        for a, b in zip(got, losses):
            assert abs(a - b) <= 1e-6 * abs(b), (rank, got, losses)


def test_muon_config_keys_and_megatron_flags():
    """Megatron's flags set the keys; bad values stop before any process group."""
    from paratron.config import ConfigError, megatron_overrides
    from paratron.rules import build_config, load_config, validate

    overrides, rest = megatron_overrides(["--optimizer", "muon", "--muon-scale-mode", "unit_rms_norm",
                                          "--muon-momentum", "0.9", "--muon-no-split-qkv",
                                          "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"])
    assert rest == []
    o = build_config(None, overrides).optimizer
    assert (o.name, o.muon_scale_mode, o.muon_momentum, o.muon_split_qkv) == ("muon", "unit_rms_norm", 0.9, False)
    assert (o.exp_avg_dtype, o.exp_avg_sq_dtype) == ("bf16", "bf16")
    for bad, msg in (("optimizer.muon_momentum=1.0", "muon_momentum"),
                     ("optimizer.muon_num_ns_steps=0", "muon_num_ns_steps"),
                     ("optimizer.offload_fraction=1.5", "offload_fraction")):
        with pytest.raises(ConfigError, match=msg):
            validate(load_config(None, [bad]), 1)
    with pytest.raises(ConfigError, match="cpu_offload is not supported"):
        validate(load_config(None, ["optimizer.name=muon", "optimizer.cpu_offload=true"]), 1)
    with pytest.raises(ConfigError, match="exp_avg_dtype"):
        load_config(None, ["optimizer.exp_avg_dtype=fp8"])
