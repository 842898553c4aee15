"""DDP, ZeRO-1, clipping and fp16 loss scaling with tensor and pipeline parallelism, on paratron's
tiny GPT (tied embeddings) run through the pipeline runtime, against one process running plain
``torch.optim.AdamW`` with ``clip_grad_norm_`` on the same model, seed and global batch.
Tolerance 1e-5 (fp32); replicas must be bitwise equal.
"""

from __future__ import annotations

import math

import pytest
import torch

from paratron.config import ModelConfig, OptimizerConfig
from paratron.models.gpt import build_model_chunks, gather_full_state
from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads, precision_dtype
from paratron.parallel.context import ParallelContext
from paratron.pipeline.partition import stage_layers
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.runtime import run_pipeline
from paratron.local_ranks import run_ranks

from helpers import gpt2_config, perturb_1d_params_

SEQ, GLOBAL_B, VOCAB, HID, LAYERS, SEED = 8, 8, 37, 16, 4, 5
STEPS = 3
IGNORE = -100


def _cfg(num_layers: int = LAYERS) -> ModelConfig:
    return gpt2_config(num_layers=num_layers, hidden_size=HID, num_attention_heads=4, vocab_size=VOCAB,
                       seq_length=SEQ, make_vocab_size_divisible_by=4)


def _opt(clip: float, **kw) -> OptimizerConfig:
    return OptimizerConfig(name="adamw", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                           adam_eps=1e-6, clip_grad=clip, **kw)


def _batch(step: int):
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_B, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GLOBAL_B, SEQ), generator=g)
    labels[torch.rand(GLOBAL_B, SEQ, generator=g) < 0.2] = IGNORE
    return ids, labels


def reference(clip: float, batches, num_layers: int = LAYERS):
    """One process, plain torch: full params by logical name, grad norm per step."""
    ctx = ParallelContext.single()
    (model,) = build_model_chunks(_cfg(num_layers), ctx, seed=SEED)
    perturb_1d_params_([model])
    params = list(model.parameters())
    cfg = _opt(clip)
    opt = torch.optim.AdamW([{"params": [p for p in params if not p.meta.no_weight_decay]},
                             {"params": [p for p in params if p.meta.no_weight_decay], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    norms = []
    for ids, labels in batches:
        opt.zero_grad()
        (model(ids, labels).sum() / (labels != IGNORE).sum()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)))
        opt.step()
    return gather_full_state([model], ctx), norms


def train(ctx, *, zero, clip, schedule="1f1b", v=1, m=2, sp=False, precision="fp32", batches=None,
          inject=None, opt_kw=None, snapshots=None, set_scale=None, reshard=True, probe=None,
          layout=None, num_layers=LAYERS, poison=None, states=None):
    """Train the GPT for len(batches) steps on this rank's part of the layout.

    ``inject(step, chunk)`` may return a term added to the loss of microbatch 0 on the last stage.
    Returns (full params of this stage, [(grad_norm, clip_coeff, skipped, loss_scale)]); when
    ``snapshots`` is a list, the full params after every step are appended to it.
    ``set_scale`` maps a step to a loss scale forced before it. ``reshard`` is ZeRO-3's
    ``zero3_reshard_after_forward``; ``probe(chunks, ddp, opt)`` is called after the last step.
    ``layout``: transformer layers per stage (``parallel.pipeline_layout``) of a ``num_layers``
    model. ``poison(step)`` may return a value written into this rank's first owned grad element
    after the grads are final (an inf or NaN on one rank). When ``states`` is a list, this rank's
    params and optimizer state (step count, main weights and moments) after every step are
    appended to it.
    """
    dtype = precision_dtype(precision)
    layers = stage_layers(num_layers, ctx.pp.size, v, layout, schedule)
    chunks = build_model_chunks(_cfg(num_layers), ctx, seed=SEED, stage_layers=layers, params_dtype=dtype,
                                sequence_parallel=sp)
    perturb_1d_params_(chunks)
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, overlap_grad_reduce=True,
                                  zero=int(zero), zero3_reshard_after_forward=reshard)
    opt = build_optimizer(chunks, ctx, _opt(clip, **(opt_kw or {})), ddp, precision=precision)
    dp, r = ctx.dp.size, ctx.dp.rank
    rows = GLOBAL_B // dp
    out = []
    for step, (ids, labels) in enumerate(batches):
        total = (labels != IGNORE).sum()
        ids, labels = ids[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows]
        mbs = rows // m
        micro = [(ids[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(m)]

        def forward_step(chunk_id, chunk, x, mb, step=step):
            tok, lab = mb
            y = chunk(tok if x is None else x, lab if chunk.post_process else None)
            if not chunk.post_process:
                return y
            loss = y.sum() / total
            if inject is not None and mb is micro[0]:
                extra = inject(step, chunk)
                if extra is not None:
                    loss = loss + extra
            return opt.scale_loss(loss)

        if set_scale and step in set_scale:
            opt.scaler.scale = set_scale[step]
        opt.zero_grad()
        actions = build_schedule(schedule, ctx.pp.size, m, v)[ctx.pp.rank]
        seq = SEQ // ctx.tp.size if sp else SEQ
        run_pipeline(actions, chunks, ctx, micro, forward_step, (seq, mbs, HID), dtype, grad_sync=ddp)
        finalize_grads(chunks, ctx, ddp)
        value = poison(step) if poison is not None else None
        if value is not None:
            ddp.owned_ranges(0)[0][2][0] = value
        res = opt.step()
        out.append((res.grad_norm, res.clip_coeff, res.skipped, res.loss_scale))
        if states is not None:
            states.append(_rank_state(chunks, opt))
        if snapshots is not None:
            with ddp.full_params():
                snapshots.append({k: t.float() for k, t in gather_full_state(chunks, ctx).items()})
    if probe is not None:
        probe(chunks, ddp, opt)
    with ddp.full_params():
        full = {k: t.float() for k, t in gather_full_state(chunks, ctx).items()}
    return full, out


def _rank_state(chunks, opt) -> dict:
    """This rank's params and optimizer state, cloned (for bitwise comparisons)."""
    out = {"step_count": opt.step_count}
    out.update({f"param/{p.meta.logical_name}": p.detach().clone() for c in chunks for p in c.parameters()})
    for key, views in opt.sharded_state_dict().items():
        out[key] = [t.clone() for t, _ in views]
    return out


# ---- AdamW + clipping parity over layouts -----------------------------------------------------

def _rank_layouts(layouts):
    res = []
    for lay in layouts:
        ctx = ParallelContext.build(tp=lay["tp"], pp=lay["pp"])
        full, steps = train(ctx, zero=lay["zero"], clip=lay["clip"], schedule=lay.get("schedule", "1f1b"),
                            v=lay.get("v", 1), m=lay.get("m", 2), sp=lay.get("sp", False),
                            reshard=lay.get("reshard", True), batches=[_batch(s) for s in range(STEPS)],
                            layout=lay.get("layout"), num_layers=lay.get("layers", LAYERS))
        coords = (ctx.tp.rank, ctx.pp.rank, ctx.dp.rank)
        res.append((coords, full, steps))
    return res


def _L(tp, pp, zero, clip=0.0, **kw):
    return dict(tp=tp, pp=pp, zero=zero, clip=clip, **kw)


WORLD4 = [  # world 4
    _L(2, 1, False), _L(2, 1, True, 0.05),                   # TP=2 x DP=2, clipping at TP=2
    _L(1, 2, False, 0.05), _L(1, 2, True),                   # PP=2 x DP=2 (1F1B), tied embedding
    _L(4, 1, False, 0.05),                                   # clipping at TP=4
    _L(2, 1, True, 0.05, sp=True),                           # sequence parallel: deferred bucket
    _L(1, 2, True, 0.05, schedule="interleaved", v=2),       # clipping at PP=2 interleaved, ZeRO
    _L(1, 2, False, schedule="zb-h1"),                       # deferred weight grads (W actions)
    _L(1, 2, True, 0.05, schedule="zbv", v=2),               # V placement: both ends on one rank
]
WORLD8 = [  # world 8
    _L(2, 2, False, 0.05), _L(2, 2, True),                   # TP=2 x PP=2 x DP=2
    _L(2, 1, True, 0.05), _L(1, 2, False),                   # TP=2 x DP=4, PP=2 x DP=4
    _L(2, 1, False), _L(1, 2, True, 0.05),
]


def _check_layouts(outs, layouts):
    refs = {}
    for i, lay in enumerate(layouts):
        where = f"{lay}"
        key = (lay["clip"], lay.get("layers", LAYERS))
        if key not in refs:
            refs[key] = reference(lay["clip"], [_batch(s) for s in range(STEPS)], num_layers=key[1])
        ref, ref_norms = refs[key]
        merged: dict[str, torch.Tensor] = {}
        steps0 = outs[0][i][2]
        for rank_out in outs:
            coords, full, steps = rank_out[i]
            assert steps == steps0, f"{where}: grad norm / clip coefficient differ on rank {coords}"
            for name, t in full.items():
                if name in merged:  # DP replicas, TP ranks after gather, tied copies: bitwise equal
                    assert torch.equal(merged[name], t), f"{where}: {name} differs between ranks"
                merged[name] = t
        assert merged.keys() == ref.keys(), where
        for name, t in ref.items():
            torch.testing.assert_close(merged[name], t, rtol=1e-5, atol=1e-5,
                                       msg=lambda msg: f"{where}: {name}: {msg}")
        for (norm, coeff, skipped, _), ref_norm in zip(steps0, ref_norms):
            assert not skipped
            assert norm == pytest.approx(ref_norm, rel=1e-5), where
            if lay["clip"]:
                assert coeff == pytest.approx(lay["clip"] / (ref_norm + 1e-6), rel=1e-5), where
                assert coeff < 1.0, f"{where}: clipping should be active"


def test_layouts_world4():
    """TP=2 x DP=2 (also with SP) and PP=2 x DP=2 with ZeRO-1 on and off, TP=4, PP=2 interleaved,
    zero-bubble ZB-H1 and ZBV (weight grads arrive in deferred W actions): 3 AdamW steps
    match one process to 1e-5; replicas bitwise equal; norms and clip coefficients match."""
    _check_layouts(run_ranks(_rank_layouts, 4, WORLD4, timeout=300), WORLD4)


def test_layouts_world8():
    """TP=2 x PP=2 x DP=2, TP=2 x DP=4 and PP=2 x DP=4, each with ZeRO-1 on and off."""
    _check_layouts(run_ranks(_rank_layouts, 8, WORLD8, timeout=400), WORLD8)


# ---- empty pipeline stages --------------------------------------------------------------------

EMPTY_STAGES = [  # PP=4, 8 layers: a stage holding no param at all trains and joins every collective
    _L(1, 4, 0, 0.05, layout=[2, 0, 3, 3], layers=8),
    _L(1, 4, 1, 0.05, layout=[0, 2, 3, 3], layers=8),
]


def test_empty_pipeline_stages_match_one_process():
    """PP=4 with pipeline_layout [2, 0, 3, 3] (an empty middle stage: no param on its rank) and
    [0, 2, 3, 3] (a first stage with only the embedding), ZeRO 0 and 1, clipping active: 3
    AdamW steps match one process to 1e-5; norms and clip coefficients match."""
    _check_layouts(run_ranks(_rank_layouts, 4, EMPTY_STAGES, timeout=300), EMPTY_STAGES)


@pytest.mark.slow
def test_empty_pipeline_stage_under_zero2_and_zero3():
    """The empty middle stage of [2, 0, 3, 3] under ZeRO-2 (no grad buffer at all) and ZeRO-3
    (no param buffer either) matches one process to 1e-5."""
    layouts = [_L(1, 4, z, 0.05, layout=[2, 0, 3, 3], layers=8) for z in (2, 3)]
    _check_layouts(run_ranks(_rank_layouts, 4, layouts, timeout=300), layouts)


# ---- non-finite grads on one rank -----------------------------------------------------------------

NONFINITE_LAYOUTS = {1: [_L(1, 1, 0)],  # world -> layouts: DP=1; DP=2 ZeRO 0-3, TP=2, PP=2
                     2: [_L(1, 1, 0), _L(1, 1, 1), _L(1, 1, 2), _L(1, 1, 3), _L(2, 1, 0), _L(1, 2, 0)]}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else
         all(torch.equal(x, y) for x, y in zip(a[k], b[k])) if isinstance(a[k], list) else a[k] == b[k])
        for k in a)


def _rank_nonfinite(layouts, precision):
    out = []
    for lay in layouts:
        ctx = ParallelContext.build(tp=lay["tp"], pp=lay["pp"])
        for value in (float("inf"), float("nan")):
            states = []
            bad = ctx.world_size - 1  # the last rank: DP rank 1, TP rank 1 or the last stage

            def poison(step, value=value):
                return value if step == 1 and ctx.rank == bad else None

            _, steps = train(ctx, zero=lay["zero"], clip=0.05, precision=precision, poison=poison,
                             batches=[_batch(s) for s in range(4)], states=states)
            out.append((f"{lay} {precision} {value}", [s[2] for s in steps],
                        _same(states[0], states[1]), _same(states[1], states[2])))
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_nonfinite_grad_on_one_rank_skips_the_step_everywhere(world, precision):
    """An inf, then (another run) a NaN, written into the last rank's final grads at step 2 of 4,
    at DP=1, DP=2 with ZeRO 0, 1, 2 and 3, TP=2 and PP=2, in fp32 and bf16: step 2 is skipped on every
    rank, with params, main weights, moments and step count after it bitwise equal to after step
    1 on every rank; step 3 updates again."""
    for rank_out in run_ranks(_rank_nonfinite, world, NONFINITE_LAYOUTS[world], precision, timeout=300):
        for where, skipped, unchanged, stepped_on in rank_out:
            assert skipped == [False, True, False, False], where
            assert unchanged, f"{where}: the skipped step changed the state"
            assert not stepped_on, f"{where}: step 3 did not update"


# ---- tied embedding under ZeRO-1 x PP ------------------------------------------------------------

def _rank_tied():
    ctx = ParallelContext.build(pp=2)
    full, _ = train(ctx, zero=True, clip=0.0, batches=[_batch(0)])
    return ctx.pp.rank, full["embedding.word_embeddings.weight"]


def test_tied_embedding_copies_equal_under_zero_pp2_dp2():
    """DP=2 x PP=2, ZeRO-1: after a step the first- and last-stage copies of the tied embedding are
    bitwise equal and match the one-process reference (1e-5)."""
    outs = run_ranks(_rank_tied, 4, timeout=300)
    stages = {s for s, _ in outs}
    assert stages == {0, 1}
    for _, emb in outs[1:]:
        assert torch.equal(emb, outs[0][1])
    ref, _ = reference(0.0, [_batch(0)])
    torch.testing.assert_close(outs[0][1], ref["embedding.word_embeddings.weight"], rtol=1e-5, atol=1e-5)


# ---- fp16 overflow on one pipeline stage -----------------------------------------------------------

def _rank_fp16(zero):
    ctx = ParallelContext.build(pp=2)
    kw = dict(initial_loss_scale=8.0, hysteresis=1, loss_scale_window=1000)
    snaps = []

    def inject(step, chunk):
        if step == 1 and ctx.dp.rank == 0:
            # Through the module (not its weight directly): under ZeRO-3 a param is only
            # materialised inside the forward of the module that owns it.
            return float("inf") * chunk.final_norm(torch.ones(1, 1, HID, dtype=torch.float16)).sum()
        return None

    full, steps = train(ctx, zero=zero, clip=1.0, precision="fp16", inject=inject, opt_kw=kw,
                        batches=[_batch(0), _batch(1), _batch(2)], snapshots=snaps)
    ref_full, ref_steps = train(ctx, zero=zero, clip=1.0, precision="fp16", opt_kw=kw,
                                batches=[_batch(0), _batch(2)], set_scale={1: 4.0})
    return steps, ref_steps, full, ref_full, snaps


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_fp16_inf_on_one_stage_skips_every_rank(zero):
    """fp16, PP=2 x DP=2: an inf in the last stage's grads on one DP rank at step 2 of 3 skips step
    2 on every rank, every rank's loss scale halves 8 -> 4, and the result matches a run whose
    step-2 batch was dropped (and whose second step uses the same scale 4, since fp16 grads
    of small values round differently under another scale) to 1e-6."""
    outs = run_ranks(_rank_fp16, 4, zero, timeout=300)
    for steps, ref_steps, full, ref_full, snaps in outs:
        assert [(s[2], s[3]) for s in steps] == [(False, 8.0), (True, 4.0), (False, 4.0)]
        assert [(s[2], s[3]) for s in ref_steps] == [(False, 8.0), (False, 4.0)]
        for n in snaps[0]:
            assert torch.equal(snaps[0][n], snaps[1][n]), f"{n} changed in the skipped step"
        assert any(not torch.equal(snaps[1][n], full[n]) for n in full), "step 3 changed nothing"
        for n in full:
            torch.testing.assert_close(full[n], ref_full[n], rtol=1e-6, atol=1e-6)


# ---- expert parallelism ---------------------------------------------------------------------------

def _moe_cfg() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=HID, num_attention_heads=4, ffn_hidden_size=32,
                       vocab_size=VOCAB, seq_length=SEQ, make_vocab_size_divisible_by=4,
                       tie_embeddings=True, num_experts=4, moe_top_k=2, moe_aux_loss_coeff=0.0,
                       moe_z_loss_coeff=0.0)


def _own_params(chunks) -> dict[str, torch.Tensor]:
    """Every param of these chunks by logical name (TP=1: dense params are whole; each expert's
    params are whole on the ranks of its EP rank)."""
    return {p.meta.logical_name: p.detach().float().clone() for c in chunks for p in c.parameters()}


def _train_moe(ctx, zero, clip, batches, m=2):
    chunks = build_model_chunks(_moe_cfg(), ctx, seed=SEED)
    perturb_1d_params_(chunks)
    if ctx.world_size == 1:
        params = list(chunks[0].parameters())
        c = _opt(clip)
        opt = torch.optim.AdamW([{"params": [p for p in params if not p.meta.no_weight_decay]},
                                 {"params": [p for p in params if p.meta.no_weight_decay], "weight_decay": 0.0}],
                                lr=c.lr, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps,
                                weight_decay=c.weight_decay)
        norms = []
        for ids, labels in batches:
            opt.zero_grad()
            total = (labels != IGNORE).sum()
            for i in range(m):  # the same microbatches as each DP rank, for the same routing
                rows = slice(i * len(ids) // m, (i + 1) * len(ids) // m)
                (chunks[0](ids[rows], labels[rows]).sum() / total).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)))
            opt.step()
        return _own_params(chunks), norms
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, zero=int(zero))
    opt = build_optimizer(chunks, ctx, _opt(clip), ddp)
    dp, r = ctx.dp.size, ctx.dp.rank
    norms = []
    for ids, labels in batches:
        total = (labels != IGNORE).sum()
        rows = len(ids) // dp
        ids, labels = ids[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows]
        opt.zero_grad()
        for i in range(m // dp):
            sl = slice(i * rows * dp // m, (i + 1) * rows * dp // m)
            (chunks[0](ids[sl], labels[sl]).sum() / total).backward()
        finalize_grads(chunks, ctx, ddp)
        res = opt.step()
        norms.append((res.grad_norm, res.clip_coeff))
    with ddp.full_params():
        return _own_params(chunks), norms


def _rank_moe(zero):
    ctx = ParallelContext.build(ep=2)
    assert ctx.dp.size == 4 and ctx.expert_dp.size == 2
    return _train_moe(ctx, zero, 0.05, [_batch(s) for s in range(STEPS)], m=4)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_expert_parallel_dp4_ep2_with_clipping(zero):
    """MoE GPT (4 experts, top-2) at DP=4 x EP=2 (expert-DP 2), ZeRO off, 1 and 3, clipping
    active: expert grads reduce over expert-DP, each expert counts once in the global norm; 3 AdamW
    steps match one process to 1e-5 and replicas are bitwise equal."""
    outs = run_ranks(_rank_moe, 4, zero, timeout=300)
    ref, ref_norms = _train_moe(ParallelContext.single(), zero, 0.05, [_batch(s) for s in range(STEPS)], m=4)
    merged = {}
    for params, norms in outs:
        assert norms == outs[0][1]
        for n, t in params.items():
            if n in merged:
                assert torch.equal(merged[n], t), f"{n} differs between replicas"
            merged[n] = t
    assert merged.keys() == ref.keys()
    for n, t in ref.items():
        torch.testing.assert_close(merged[n], t, rtol=1e-5, atol=1e-5, msg=lambda msg: f"{n}: {msg}")
    for (norm, coeff), ref_norm in zip(outs[0][1], ref_norms):
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert coeff == pytest.approx(0.05 / (ref_norm + 1e-6), rel=1e-5) and coeff < 1
