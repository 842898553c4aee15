"""Optimizer pieces: LR schedules, the loss scaler, mixed precision (bf16 main weights, fp16
overflow skipping), SGD, the checkpoint view of the state, and input errors."""

from __future__ import annotations

import math

import pytest
import torch

from paratron.config import OptimizerConfig
from paratron.optim import (DistributedDataParallel, DynamicLossScaler, build_lr_scheduler, build_optimizer,
                            finalize_grads)
from paratron.optim.state_chunks import rectangles
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import accumulate_grad
from paratron.parallel.params import ShardSpec
from paratron.local_ranks import run_ranks

from test_optim_dp import IGNORE, Toy, batch, opt_cfg, reference, torch_adamw, train_dp


# ---- LR ---------------------------------------------------------------------------------------

def _lrs(style, n=12, **kw):
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=2, lr_decay_style=style, **kw)
    s = build_lr_scheduler(cfg, train_iters=10)
    out = [s.lr]
    for _ in range(n - 1):
        out.append(s.step())
    return out


def test_lr_warmup_then_cosine_linear_constant_wsd():
    """Linear warmup to the peak, then each decay style reaches min_lr at lr_decay_iters."""
    cos = _lrs("cosine")
    assert cos[:2] == [0.5, 1.0]
    assert cos[2] == pytest.approx(1.0)
    assert cos[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert cos[10:] == [0.1, 0.1]
    lin = _lrs("linear")
    assert lin[6] == pytest.approx(1.0 - 0.9 * 4 / 8) and lin[10] == 0.1
    assert _lrs("constant")[2:] == [1.0] * 10
    wsd = _lrs("wsd", lr_wsd_decay_iters=4)
    assert wsd[2:6] == [1.0] * 4
    assert wsd[6:10] == pytest.approx([1.0, 1.0 - 0.9 / 4, 1.0 - 0.9 / 2, 1.0 - 0.9 * 3 / 4])
    assert wsd[10] == 0.1


def test_lr_scheduler_sets_optimizer_lr_and_round_trips():
    class Opt:
        lr = None

        def set_lr(self, lr):
            self.lr = lr

    cfg = OptimizerConfig(lr=2.0, min_lr=0.0, lr_warmup_iters=4, lr_decay_style="cosine")
    opt = Opt()
    s = build_lr_scheduler(cfg, 20, optimizer=opt)
    assert opt.lr == 0.5
    for _ in range(7):
        s.step()
    s2 = build_lr_scheduler(cfg, 20)
    s2.load_state_dict(s.state_dict())
    assert s2.lr == s.lr == opt.lr


def test_lr_bad_input_names_the_field():
    with pytest.raises(ValueError, match="min_lr"):
        build_lr_scheduler(OptimizerConfig(lr=0.1, min_lr=0.5), 10)
    with pytest.raises(ValueError, match="lr_warmup_iters"):
        build_lr_scheduler(OptimizerConfig(lr_warmup_iters=-1), 10)


def test_lr_warmup_longer_than_the_run_keeps_rising():
    """A smoke run shorter than the config's warmup is allowed (as in Megatron-LM):
    the lr rises linearly for the whole run and never reaches the peak or decays."""
    s = build_lr_scheduler(OptimizerConfig(lr=3.0, min_lr=0.0, lr_warmup_iters=30), 4)
    lrs = [s.lr_at(n) for n in range(4)]
    assert lrs == pytest.approx([3.0 * (n + 1) / 30 for n in range(4)])
    build_lr_scheduler(OptimizerConfig(lr=3.0, lr_warmup_iters=30, lr_decay_style="wsd"), 4)


# ---- loss scaler ------------------------------------------------------------------------------

def test_dynamic_loss_scaler_hysteresis_and_growth():
    s = DynamicLossScaler(initial_scale=64, min_scale=4, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 64  # first overflow absorbed by hysteresis
    s.update(True)
    assert s.scale == 32
    s.update(True)
    assert s.scale == 16  # hysteresis only resets when the scale grows
    for _ in range(3):
        s.update(False)
    assert s.scale == 32 and s.hysteresis_tracker == 2
    for _ in range(10):
        s.update(True)
    assert s.scale == 4  # floor
    t = DynamicLossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match="optimizer.hysteresis"):
        DynamicLossScaler(hysteresis=0)


# ---- bf16 main weights ------------------------------------------------------------------------

def _grads(step, model):
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(p.shape, generator=g) * 0.1 for n, p in model.named_parameters()}


def test_bf16_params_with_fp32_main_weights_match_torch_adamw():
    """bf16 model params, fp32 main grads and weights: given the same fp32 grads, 3 steps give
    main weights equal to torch.optim.AdamW on fp32 params (1e-6) and params equal to the main
    weights rounded to bf16."""
    ctx = ParallelContext.single()
    model = Toy(dtype=torch.bfloat16)
    ddp = DistributedDataParallel([model], ctx)
    opt = build_optimizer([model], ctx, opt_cfg(), ddp, precision="bf16")
    ref = Toy(dtype=torch.bfloat16).float()
    cfg = opt_cfg()
    tref = torch_adamw(ref, model, cfg)
    for step in range(3):
        opt.zero_grad()
        tref.zero_grad()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            g = _grads(step, model)[n]
            accumulate_grad(p, g)  # fp32 grad into the fp32 main grad
            q.grad = g.clone()
        finalize_grads([model], ctx, ddp)
        assert not opt.step().skipped
        tref.step()
    sd = opt.sharded_state_dict()
    for n, q in ref.named_parameters():
        main = _assemble([sd], f"optimizer/main_param/{getattr(model, n).meta.logical_name}")
        full = q.detach()[: main.shape[0]] if n == "emb" else q.detach().reshape(main.shape)
        torch.testing.assert_close(main, full.reshape(main.shape), rtol=1e-6, atol=1e-6)
        p = getattr(model, n)
        assert p.dtype == torch.bfloat16
        assert torch.equal(p.detach(), q.detach().to(torch.bfloat16))


# ---- fp16: a global overflow skips the step everywhere ----------------------------------------

def _rank_fp16(zero):
    ctx = ParallelContext.build()
    cfg = opt_cfg(initial_loss_scale=8.0, hysteresis=1, loss_scale_window=1000, clip_grad=1.0)
    snaps = []

    def inject(step, model):
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if step == 1 and ctx.dp.rank == 1:
            return float("inf") * model.norm_w.sum()
        return None

    def run(batches, inject_fn):
        return train_dp(ctx, cfg, steps=len(batches), zero=zero, overlap=True,
                        precision="fp16", batches=batches, inject_loss=inject_fn)

    batches = [batch(0), batch(1), batch(2)]
    params, results, _, opt = run(batches, inject)
    after2 = snaps[2]
    ref_params, ref_results, _, ref_opt = run([batch(0), batch(2)], None)
    return ([(r.skipped, r.loss_scale) for r in results], snaps[1], after2, params,
            [(r.skipped, r.loss_scale) for r in ref_results], ref_params)


@pytest.mark.parametrize("zero", [False, True])
def test_fp16_overflow_on_one_rank_skips_everywhere(zero):
    """fp16, DP=2, inf in rank 1's grads at step 2 of 3 (loss scale 8, hysteresis 1): every rank
    skips step 2 (params unchanged), every rank's scale goes 8 -> 4, and the final params match a
    run whose step-2 batch was dropped, to 1e-6."""
    outs = run_ranks(_rank_fp16, 2, zero, timeout=180)
    for steps, before2, after2, params, ref_steps, ref_params in outs:
        assert steps == [(False, 8.0), (True, 4.0), (False, 4.0)]
        for n in before2:
            assert torch.equal(before2[n], after2[n]), f"{n} changed in a skipped step"
        assert ref_steps == [(False, 8.0), (False, 8.0)]
        for n in params:
            torch.testing.assert_close(params[n], ref_params[n], rtol=1e-6, atol=1e-6)
    assert all(torch.equal(outs[0][3][n], outs[1][3][n]) for n in outs[0][3])


# ---- SGD ---------------------------------------------------------------------------------------

def _rank_sgd(zero):
    ctx = ParallelContext.build()
    cfg = opt_cfg(name="sgd", lr=0.1, sgd_momentum=0.9, weight_decay=0.01)
    return train_dp(ctx, cfg, steps=3, zero=zero, overlap=True)[0]


@pytest.mark.parametrize("zero", [False, True])
def test_sgd_momentum_parity_dp2(zero):
    """SGD with momentum and L2 weight decay, DP=2: 3 steps match torch.optim.SGD to 1e-5."""
    outs = run_ranks(_rank_sgd, 2, zero, timeout=180)
    ref, _ = reference(3, opt_cfg(name="sgd", lr=0.1, sgd_momentum=0.9, weight_decay=0.01))
    for n, p in ref.items():
        torch.testing.assert_close(outs[0][n], p, rtol=1e-5, atol=1e-5)
        assert torch.equal(outs[0][n], outs[1][n])


# ---- checkpoint view of the state -------------------------------------------------------------

def _assemble(dicts, key):
    """Full 2-D tensor of ``key`` from every rank's chunks; asserts each element appears once
    per distinct chunk position and that duplicates agree."""
    chunks = [c for d in dicts for c in d.get(key, [])]
    assert chunks, key
    shape = chunks[0][1].global_shape
    full = torch.full(shape, float("nan"))
    for t, spec in chunks:
        assert spec.global_shape == shape
        region = full[spec.slices()]
        done = ~torch.isnan(region)
        assert torch.equal(region[done], t.float()[done]), f"{key}: overlapping chunks disagree"
        region.copy_(t.float())
    assert not torch.isnan(full).any(), f"{key}: not every element is covered"
    return full


def _rank_state(zero):
    ctx = ParallelContext.build()
    params, _, ddp, opt = train_dp(ctx, opt_cfg(), steps=2, zero=zero, overlap=True,
                                   model_kw={"pad_rows": 3})
    sd = opt.sharded_state_dict()
    snapshot = {k: [(t.clone(), s) for t, s in v] for k, v in sd.items()}
    # Write-through: fill main weights with 2x their value in place, then reload.
    for k, v in sd.items():
        if k.startswith("optimizer/main_param/"):
            for t, _ in v:
                t.mul_(2.0)
    opt.reload_model_params()
    doubled = {n: p.detach().clone() for n, p in ddp.chunks[0].named_parameters()}
    return params, snapshot, doubled


@pytest.mark.parametrize("zero", [False, True])
def test_sharded_state_dict_matches_torch_state(zero):
    """DP=2 (ZeRO-1: shard boundaries inside params, 3 vocab-padding rows excluded): the chunks of
    all ranks assemble to the full main weights (= the params) and AdamW moments of torch's
    single-process run (1e-5); the chunks are views (filling them, then reload_model_params,
    changes the params on every rank)."""
    outs = run_ranks(_rank_state, 2, zero, timeout=180)
    sds = [o[1] for o in outs]
    ref_model = Toy(pad_rows=3)
    decay = [p for p in ref_model.parameters() if not p.meta.no_weight_decay]
    nodecay = [p for p in ref_model.parameters() if p.meta.no_weight_decay]
    cfg = opt_cfg()
    topt = torch.optim.AdamW([{"params": decay}, {"params": nodecay, "weight_decay": 0.0}], lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)
    for step in range(2):
        tokens, labels = batch(step)
        topt.zero_grad()
        (ref_model(tokens, labels).sum() / (labels != IGNORE).sum()).backward()
        topt.step()
    for n, p in ref_model.named_parameters():
        name = p.meta.logical_name
        valid = p.detach()[: p.meta.shard.local_shape[0]] if n == "emb" else p.detach()
        two_d = valid.reshape(1, -1) if valid.dim() == 1 else valid
        torch.testing.assert_close(_assemble(sds, f"optimizer/main_param/{name}"), two_d,
                                   rtol=1e-5, atol=1e-5)
        st = topt.state[p]
        for kind in ("exp_avg", "exp_avg_sq"):
            ref = st[kind][: p.meta.shard.local_shape[0]] if n == "emb" else st[kind]
            torch.testing.assert_close(_assemble(sds, f"optimizer/{kind}/{name}"),
                                       ref.reshape(two_d.shape), rtol=1e-5, atol=1e-6)
        for params, _, doubled in outs:
            torch.testing.assert_close(doubled[n], 2 * params[n], rtol=0, atol=0)
    if zero:  # each rank holds about half of the state
        sizes = [sum(t.numel() for t, _ in sd["optimizer/exp_avg/fc1_w"]) for sd in sds]
        assert sum(sizes) == Toy().fc1_w.numel() and min(sizes) > 0


def test_rectangles_of_a_flat_range():
    """A flat range of a [4, 5] shard at global offset (2, 5) of a [10, 10] tensor: partial first
    row, whole middle rows, partial last row."""
    spec = ShardSpec((10, 10), (2, 5), (4, 5))
    rects = rectangles((4, 5), spec, 3, 17)
    assert [(a, b) for a, b, _ in rects] == [(3, 5), (5, 15), (15, 17)]
    assert [r.offsets for _, _, r in rects] == [(2, 8), (3, 5), (5, 5)]
    assert [r.local_shape for _, _, r in rects] == [(1, 2), (2, 5), (1, 2)]
    # Vocab padding rows (local rows 3.. are padding) are dropped.
    pad = ShardSpec((10, 10), (8, 5), (2, 5))
    assert [r.local_shape for _, _, r in rectangles((4, 5), pad, 3, 17)] == [(1, 2), (1, 5)]


# ---- errors -----------------------------------------------------------------------------------

def test_bad_input_errors_name_the_field():
    ctx = ParallelContext.single()
    model = Toy()
    with pytest.raises(ValueError, match="train.precision"):
        build_optimizer([model], ctx, opt_cfg(), precision="fp8")
    unmarked = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="mark"):
        DistributedDataParallel([unmarked], ctx)
    with pytest.raises(ValueError, match="optimizer.name"):
        build_optimizer([model], ctx, opt_cfg(name="lamb"))


def _rank_bf16(zero):
    ctx = ParallelContext.build()
    params, res, _, _ = train_dp(ctx, opt_cfg(clip_grad=0.05), steps=3, zero=zero, overlap=True,
                                 precision="bf16")
    return params, [(r.grad_norm, r.clip_coeff) for r in res]


def test_bf16_dp2_zero_matches_ddp():
    """bf16 params at DP=2: ZeRO-1 (bf16 all-gather of params cast from fp32 main weights) and
    plain DDP give the same params (bitwise: each element's update is the same arithmetic) and
    the same grad norms (1e-6), and replicas are bitwise equal."""
    zero = run_ranks(_rank_bf16, 2, True, timeout=180)
    ddp = run_ranks(_rank_bf16, 2, False, timeout=180)
    for r in range(2):
        for n, p in ddp[r][0].items():
            assert torch.equal(zero[r][0][n], p), n
            assert torch.equal(zero[r][0][n], zero[0][0][n]), n
        for (a, ca), (b, cb) in zip(zero[r][1], ddp[r][1]):
            assert a == pytest.approx(b, rel=1e-6) and ca == pytest.approx(cb, rel=1e-6)
