"""Data parallelism, ZeRO-1 and the optimizer on a toy LM, against single-process torch runs.

The toy model mixes both grad paths of the contract: two linears send their weight grads through
``paratron.parallel.grads.accumulate_grad`` (like paratron's parallel linears), the embedding,
norm and head get ordinary autograd ``.grad``. References are plain PyTorch on one process:
``loss.backward()``, ``torch.nn.utils.clip_grad_norm_``, ``torch.optim.AdamW`` / ``SGD``.
Tolerance 1e-5 (fp32) unless stated.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import OptimizerConfig
from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads, precision_dtype
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import accumulate_grad
from paratron.parallel.params import ShardSpec, mark
from paratron.local_ranks import run_ranks

VOCAB, HID, SEQ, GLOBAL_B = 11, 16, 8, 8
IGNORE = -100


class _AccumLinearFn(torch.autograd.Function):
    """y = x W^T + b; weight and bias grads go through accumulate_grad, not autograd."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.params = (w, b)
        return x.matmul(w.t()) + b

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        wp, bp = ctx.params
        dy2 = dy.reshape(-1, dy.shape[-1])
        accumulate_grad(wp, dy2.t().matmul(x.reshape(-1, x.shape[-1])))
        accumulate_grad(bp, dy2.sum(0))
        return dy.matmul(w), None, None


class Toy(nn.Module):
    """tokens [b, s] -> per-token losses [b, s] (0 where the label is ignored)."""

    def __init__(self, seed: int = 0, dtype=torch.float32, pad_rows: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: nn.Parameter((torch.randn(*s, generator=g) * 0.3).to(dtype))  # noqa: E731
        # The embedding carries `pad_rows` zero rows at the end, like vocab padding.
        emb = torch.cat([torch.randn(VOCAB, HID, generator=g) * 0.3, torch.zeros(pad_rows, HID)])
        self.emb = nn.Parameter(emb.to(dtype))
        self.fc1_w, self.fc1_b = r(2 * HID, HID), r(2 * HID)
        self.fc2_w, self.fc2_b = r(HID, 2 * HID), r(HID)
        self.norm_w = nn.Parameter(torch.ones(HID, dtype=dtype))
        self.norm_b = nn.Parameter(torch.zeros(HID, dtype=dtype))
        self.head = r(VOCAB, HID)
        mark(self.emb, "emb", ShardSpec((VOCAB, HID), (0, 0), (VOCAB, HID)))
        for n in ("fc1_w", "fc2_w", "head"):
            mark(getattr(self, n), n)
        for n in ("fc1_b", "fc2_b", "norm_w", "norm_b"):
            mark(getattr(self, n), n, no_weight_decay=True)

    def embed(self, tokens):
        return F.embedding(tokens, self.emb)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        h = F.gelu(_AccumLinearFn.apply(x, self.fc1_w, self.fc1_b))
        x = x + _AccumLinearFn.apply(h, self.fc2_w, self.fc2_b)
        x = F.layer_norm(x, (HID,), self.norm_w, self.norm_b)
        logits = x.matmul(self.head.t()).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORE,
                               reduction="none").view_as(labels)


def batch(step: int, valid=None):
    """Global batch [GLOBAL_B, SEQ] of tokens and labels; ``valid`` = valid labels per row."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_B, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GLOBAL_B, SEQ), generator=g)
    labels[torch.rand(GLOBAL_B, SEQ, generator=g) < 0.25] = IGNORE
    return tokens, labels


def opt_cfg(**kw) -> OptimizerConfig:
    base = dict(name="adamw", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                adam_eps=1e-8, clip_grad=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


def torch_adamw(ref: nn.Module, marked: nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``ref``'s params as ``cfg`` says, without weight decay for the
    params that ``marked`` (a Toy with the same names) marks ``no_weight_decay``."""
    decay = [p for n, p in ref.named_parameters() if not getattr(marked, n).meta.no_weight_decay]
    nodecay = [p for n, p in ref.named_parameters() if getattr(marked, n).meta.no_weight_decay]
    return torch.optim.AdamW([{"params": decay}, {"params": nodecay, "weight_decay": 0.0}], lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)


def reference(steps: int, cfg: OptimizerConfig, batches=None):
    """Single-process torch run: params, grad norms per step."""
    model = Toy()
    decay = [p for p in model.parameters() if not p.meta.no_weight_decay]
    no_decay = [p for p in model.parameters() if p.meta.no_weight_decay]
    if cfg.name == "adamw":
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                                betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    else:
        opt = torch.optim.SGD([{"params": decay, "weight_decay": cfg.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                              momentum=cfg.sgd_momentum)
    norms = []
    for step in range(steps):
        tokens, labels = batches[step] if batches else batch(step)
        opt.zero_grad()
        losses = model(tokens, labels)
        (losses.sum() / (labels != IGNORE).sum()).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                               cfg.clip_grad if cfg.clip_grad > 0 else math.inf)
        norms.append(float(total))
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def last_backward_if(ddp, last: bool):
    """DDP's last-backward block around the last microbatch's backward, else nothing."""
    return ddp.last_backward() if last else contextlib.nullcontext()


def train_dp(ctx, cfg, *, steps, zero, overlap, microbatches=2, bucket_mb=0.0005,
             precision="fp32", batches=None, inject_loss=None, model_kw=None):
    """Train a Toy on this DP rank's rows; returns (params, step results, ddp, opt).

    ``inject_loss(step, model)`` may return a term added to the step's first microbatch loss.
    """
    model = Toy(dtype=precision_dtype(precision), **(model_kw or {}))
    ddp = DistributedDataParallel([model], ctx, bucket_size_mb=bucket_mb,
                                  overlap_grad_reduce=overlap, zero=int(zero))
    opt = build_optimizer([model], ctx, cfg, ddp, precision=precision)
    results = []
    dp, r = ctx.dp.size, ctx.dp.rank
    for step in range(steps):
        tokens, labels = batches[step] if batches else batch(step)
        denom = (labels != IGNORE).sum()
        rows = GLOBAL_B // dp
        tokens, labels = tokens[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows]
        opt.zero_grad()
        extra = inject_loss(step, model) if inject_loss is not None else None
        for i, (t, lab) in enumerate(zip(tokens.chunk(microbatches), labels.chunk(microbatches))):
            loss = model(t, lab).sum() / denom
            if extra is not None:
                loss, extra = loss + extra, None
            with last_backward_if(ddp, i == microbatches - 1):
                opt.scale_loss(loss).backward()
        finalize_grads([model], ctx, ddp)
        results.append(opt.step())
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return params, results, ddp, opt


# ---- DP parity ------------------------------------------------------------------------------

CONFIGS = [  # (zero, overlap, clip)
    (False, True, 0.0), (True, True, 0.05), (False, False, 0.05), (True, False, 0.0),
]


def _rank_parity(configs, steps):
    out = []
    for zero, overlap, clip in configs:
        ctx = ParallelContext.build()
        params, res, _, _ = train_dp(ctx, opt_cfg(clip_grad=clip), steps=steps, zero=zero,
                                     overlap=overlap)
        out.append((params, [(r.grad_norm, r.clip_coeff, r.skipped) for r in res]))
    return out


@pytest.mark.parametrize("world,configs", [(2, CONFIGS), (4, [CONFIGS[0], CONFIGS[1]])])
def test_adamw_parity_dp(world, configs):
    """DP=2 and DP=4, ZeRO-1 on/off, overlap on/off, clipping on/off, 2 microbatches: after 3
    AdamW steps the params match one-process torch.optim.AdamW to 1e-5 and are bitwise equal
    across DP replicas; grad norms match torch's clip_grad_norm_; clip coefficients agree."""
    outs = run_ranks(_rank_parity, world, configs, 3, timeout=180)
    for c, (zero, overlap, clip) in enumerate(configs):
        ref, ref_norms = reference(3, opt_cfg(clip_grad=clip))
        params0, steps0 = outs[0][c]
        for name, p in ref.items():
            torch.testing.assert_close(params0[name], p, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name} zero={zero} overlap={overlap}: {m}")
        for r in range(1, world):
            params_r, steps_r = outs[r][c]
            for name in ref:
                assert torch.equal(params_r[name], params0[name]), f"{name} differs on DP rank {r}"
            assert steps_r == steps0, "grad norm / clip coefficient differ across ranks"
        for (norm, coeff, skipped), ref_norm in zip(steps0, ref_norms):
            assert not skipped
            assert norm == pytest.approx(ref_norm, rel=1e-5)
            want = min(1.0, clip / (ref_norm + 1e-6)) if clip > 0 else 1.0
            assert coeff == pytest.approx(want, rel=1e-5)
        if clip > 0:
            assert steps0[0][1] < 1.0, "the test's max norm should make clipping active"


# ---- uneven valid tokens --------------------------------------------------------------------

UNEVEN = [[100, 10], [50, 1]]  # valid labels per microbatch, per DP rank


def _uneven_batches():
    """Per rank, two microbatches [2, 64] whose valid-label counts are UNEVEN[rank]."""
    g = torch.Generator().manual_seed(7)
    out = []
    for counts in UNEVEN:
        mbs = []
        for n in counts:
            tokens = torch.randint(0, VOCAB, (2, 64), generator=g)
            labels = torch.randint(0, VOCAB, (2, 64), generator=g)
            flat = labels.view(-1)
            keep = torch.randperm(128, generator=g)[:n]
            mask = torch.ones(128, dtype=torch.bool)
            mask[keep] = False
            flat[mask] = IGNORE
            mbs.append((tokens, labels))
        out.append(mbs)
    return out


def _rank_uneven(zero):
    ctx = ParallelContext.build()
    data = _uneven_batches()
    model = Toy()
    ddp = DistributedDataParallel([model], ctx, bucket_size_mb=0.0005, zero=int(zero))
    # SGD with lr 1 and no decay: the update is exactly minus the gradient.
    opt = build_optimizer([model], ctx, opt_cfg(name="sgd", lr=1.0, weight_decay=0.0), ddp)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    denom = sum(int((lab != IGNORE).sum()) for mbs in data for _, lab in mbs)
    opt.zero_grad()
    for tokens, labels in data[ctx.dp.rank]:
        (model(tokens, labels).sum() / denom).backward()
    finalize_grads([model], ctx, ddp)
    grads = None
    if not zero:
        grads = {n: p.meta.main_grad.clone() for n, p in model.named_parameters()}
    opt.step()
    update = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    return denom, grads, update


@pytest.mark.parametrize("zero", [False, True])
def test_uneven_valid_tokens(zero):
    """DP=2, 2 microbatches per rank with [100, 10] and [50, 1] valid tokens: the gradient equals
    the one-process gradient of the token mean over all 161 tokens (1e-5), read from the main
    grads (DDP) or from an SGD lr=1 update (ZeRO-1, whose grads live in shards)."""
    outs = run_ranks(_rank_uneven, 2, zero, timeout=180)
    data = _uneven_batches()
    model = Toy()
    losses = [model(t, lab) for mbs in data for t, lab in mbs]
    count = sum(int((lab != IGNORE).sum()) for mbs in data for _, lab in mbs)
    assert count == 161
    (sum(ls.sum() for ls in losses) / count).backward()
    for denom, grads, update in outs:
        assert denom == 161
        for n, p in model.named_parameters():
            if grads is not None:
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(update[n], p.grad, rtol=1e-4, atol=2e-6)


# ---- grad accumulation and overlap ------------------------------------------------------------

def _rank_overlap(overlap):
    ctx = ParallelContext.build()
    model = Toy()
    ddp = DistributedDataParallel([model], ctx, bucket_size_mb=0.0005, overlap_grad_reduce=overlap)
    opt = build_optimizer([model], ctx, opt_cfg(), ddp)
    n_buckets = sum(len(b.buckets) for b in ddp.buffers)
    seen = []
    for step in range(3):
        tokens, labels = batch(step)
        denom = (labels != IGNORE).sum()
        opt.zero_grad()
        with ctx.ledger.recording():
            for i, (t, lab) in enumerate(zip(tokens.chunk(4), labels.chunk(4))):
                with last_backward_if(ddp, i == 3):
                    (model(t, lab).sum() / denom).backward()
                seen.append((step, i, ddp.num_launched()))
            finalize_grads([model], ctx, ddp)
            opt.step()
            calls = ctx.ledger.total("all_reduce", "dp_cp").calls
        seen.append((step, "calls", calls))
    return n_buckets, seen


@pytest.mark.parametrize("overlap", [True, False])
def test_accumulation_reduces_once_and_overlaps(overlap):
    """4 microbatches per step: no bucket is reduced before the last microbatch; each bucket is
    all-reduced exactly once per step; with overlap on, from the first step every non-deferred
    bucket has started during backward of the last microbatch; with overlap off none has."""
    n_buckets, seen = run_ranks(_rank_overlap, 2, overlap, timeout=180)[0]
    assert n_buckets >= 3
    for step, i, v in seen:
        if i == "calls":
            assert v == n_buckets, f"step {step}: {v} all-reduces for {n_buckets} buckets"
        elif i < 3 or not overlap:
            assert v == 0, f"step {step} microbatch {i}: {v} buckets launched early"
        else:
            assert v == n_buckets, f"step {step}: only {v}/{n_buckets} buckets overlapped"


class Gated(Toy):
    """Toy with two params whose use changes from step to step: ``late`` (a linear, grads through
    ``accumulate_grad``) is used only from step 1 on, like a layer unfrozen after the first step;
    ``some_b`` (an autograd bias) is used only in the microbatches listed in ``some``."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.late_w = nn.Parameter(torch.randn(HID, HID, generator=g) * 0.3)
        self.late_b = nn.Parameter(torch.zeros(HID))
        self.some_b = nn.Parameter(torch.randn(HID, generator=g) * 0.1)
        mark(self.late_w, "late_w")
        for n in ("late_b", "some_b"):
            mark(getattr(self, n), n, no_weight_decay=True)
        self.use_late, self.use_some = False, False

    def embed(self, tokens):
        x = F.embedding(tokens, self.emb)
        if self.use_late:
            x = x + _AccumLinearFn.apply(x, self.late_w, self.late_b)
        return x + self.some_b if self.use_some else x


# (microbatches per DP rank, late used, microbatches that use some_b) per step
GATED_STEPS = [(2, False, {0}), (4, True, {1, 3}), (1, True, set()), (2, True, {1})]


def _rank_gated(overlap):
    ctx = ParallelContext.build()
    model = Gated()
    ddp = DistributedDataParallel([model], ctx, bucket_size_mb=0.0001, overlap_grad_reduce=overlap)
    opt = build_optimizer([model], ctx, opt_cfg(), ddp)
    grads, launched = [], []
    rows = GLOBAL_B // ctx.dp.size
    for step, (m, late, some) in enumerate(GATED_STEPS):
        tokens, labels = batch(step)
        denom = (labels != IGNORE).sum()
        mine = slice(ctx.dp.rank * rows, (ctx.dp.rank + 1) * rows)
        opt.zero_grad()
        model.use_late = late
        for i, (t, lab) in enumerate(zip(tokens[mine].chunk(m), labels[mine].chunk(m))):
            model.use_some = i in some
            with last_backward_if(ddp, i == m - 1):
                (model(t, lab).sum() / denom).backward()
        launched.append(ddp.num_launched())
        finalize_grads([model], ctx, ddp)
        grads.append({n: p.meta.main_grad.clone() for n, p in model.named_parameters()})
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return grads, params, launched, sum(len(b.buckets) for b in ddp.buffers)


def test_params_used_unevenly_across_steps_overlap_bitwise():
    """DP=2, a bucket per param or two: a linear unused in step 1 and used from step 2 on (a layer
    unfrozen late), a bias used in a changing subset of microbatches, and 2, 4, 1, 2 microbatches
    per step. With overlap on, buckets are reduced during the last backward from the first step;
    the main grads of every step and the params after 4 AdamW steps are bitwise equal to overlap
    off, on every rank."""
    on = run_ranks(_rank_gated, 2, True, timeout=180)
    off = run_ranks(_rank_gated, 2, False, timeout=180)
    for r in range(2):
        grads_on, params_on, launched, n_buckets = on[r]
        grads_off, params_off, launched_off, _ = off[r]
        assert n_buckets >= 8 and launched_off == [0] * len(GATED_STEPS)
        assert all(0 < k <= n_buckets for k in launched), launched
        for step, (a, b) in enumerate(zip(grads_on, grads_off)):
            for n in a:
                assert torch.equal(a[n], b[n]), f"rank {r} step {step}: main grad of {n} differs"
        assert not grads_on[0]["late_w"].any() and grads_on[1]["late_w"].any()
        for n in params_on:
            assert torch.equal(params_on[n], params_off[n]), f"rank {r}: {n} differs"


# ---- ledger -----------------------------------------------------------------------------------

def _rank_ledger(zero):
    ctx = ParallelContext.build()
    model = Toy()
    ddp = DistributedDataParallel([model], ctx, bucket_size_mb=0.0005, zero=int(zero))
    opt = build_optimizer([model], ctx, opt_cfg(), ddp)
    tokens, labels = batch(0)
    opt.zero_grad()
    with ctx.ledger.recording():
        (model(tokens, labels).sum() / (labels != IGNORE).sum()).backward()
        finalize_grads([model], ctx, ddp)
        opt.step()
        return ctx.ledger.summary(), ctx.dp_cp.size


def _wire_bytes(summary, n):
    """Bytes each rank sends on the DP group, by the ring algorithm's analysis."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1}
    total = 0.0
    for key, e in summary.items():
        op, group = key.split("@")
        if group == "dp_cp":
            total += factor[op] * e["bytes"]
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_ledger_zero_moves_same_bytes_as_ddp(world):
    """ZeRO-1's reduce-scatter + all-gather move the same bytes as DDP's all-reduce (analytic
    ratio 1.00, from the ledger's recorded payloads)."""
    ddp_summary, n = run_ranks(_rank_ledger, world, False, timeout=180)[0]
    zero_summary, _ = run_ranks(_rank_ledger, world, True, timeout=180)[0]
    assert "reduce_scatter@dp_cp" in zero_summary and "all_gather@dp_cp" in zero_summary
    assert "all_reduce@dp_cp" not in zero_summary
    ratio = _wire_bytes(zero_summary, n) / _wire_bytes(ddp_summary, n)
    assert ratio == pytest.approx(1.0, abs=1e-12)


# ---- memory -----------------------------------------------------------------------------------

def _rank_memory(precision):
    ctx = ParallelContext.build()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = Toy(dtype=dtype)
    ddp = DistributedDataParallel([model], ctx, bucket_size_mb=0.0005, zero=1)
    return build_optimizer([model], ctx, opt_cfg(), ddp, precision=precision).state_bytes()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero_state_memory(precision):
    """Optimizer-state bytes per rank with ZeRO-1 at DP=4 <= 1.05 x (DP=1 bytes / 4), from the
    storages the optimizer allocated (fp32: the moments, main weights alias the params; bf16:
    fp32 main weights too)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = Toy(dtype=dtype)
    ctx = ParallelContext.single()
    single = build_optimizer([model], ctx, opt_cfg(), DistributedDataParallel([model], ctx),
                             precision=precision).state_bytes()
    n_params = sum(p.numel() for p in model.parameters())
    assert single == (3 if precision == "bf16" else 2) * 4 * n_params
    per_rank = run_ranks(_rank_memory, 4, precision, timeout=180)
    for b in per_rank:
        assert b <= 1.05 * single / 4, (b, single)
