"""The fused output-layer GEMM + cross-entropy (``fused_linear_cross_entropy``) at TP=1 against
a float64 ground truth (``F.cross_entropy`` of the fp64 logits over the true vocab) and the
unfused composition ``vocab_parallel_cross_entropy(vocab_parallel_logits(...))``: the same
per-token losses and input / weight grads within fp32 rounding (2e-6 of the largest magnitude
against fp64; the unfused path, whose backward exponentiates ``log p``, is checked against the
same truth at 5e-6), with a padded vocab, label smoothing, ``ignore_index`` rows, per-token
upstream grads, a tied (autograd) and an untied (main-grad path) weight; padded weight rows get
exactly zero grad and ignored rows contribute nothing. At TP=2 (SP off and on, tied and untied)
the two paths' losses agree bitwise and both match the fp64 truth of the gathered weight."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratron.layers import ParallelLMHead, vocab_parallel_cross_entropy, vocab_parallel_logits
from paratron.layers.cross_entropy import fused_linear_cross_entropy
from paratron.local_ranks import run_ranks
from paratron.parallel.context import ParallelContext

CASES = [(v, eps, tied) for v in (250, 256) for eps in (0.0, 0.1) for tied in (False, True)]


def _data(vocab):
    """Hidden states ``[6, 3, 16]``, labels (an ignored row, the last vocab id) and upstream grads."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, 16, generator=g) * 3
    labels = torch.randint(0, vocab, (6, 3), generator=g)
    labels[0] = -100
    labels[2, 1] = vocab - 1
    return x, labels, torch.randn(6, 3, generator=g)


def _head(vocab, ctx):
    return ParallelLMHead(vocab, 16, ctx, logical_name="o", seed=1, make_vocab_size_divisible_by=128)


def _inputs(vocab):
    ctx = ParallelContext.single()
    return (ctx, _head(vocab, ctx), *_data(vocab))


def _run(mode, vocab, eps, tied):
    """(losses, input grad, weight grad) by ``mode``: "fused", "unfused" or "fp64"."""
    ctx, head, x, labels, up = _inputs(vocab)
    owner = None if tied else head
    if mode == "fp64":
        x, w = x.double().requires_grad_(True), head.weight.detach().double().requires_grad_(True)
        logits = (x @ w.t())[..., :vocab]
        loss = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none",
                               label_smoothing=eps).view(labels.shape)
        (loss * up.double()).sum().backward()
        return loss.detach(), x.grad, w.grad
    x.requires_grad_(True)
    if mode == "fused":
        loss = fused_linear_cross_entropy(x, head.weight, labels, ctx, vocab, owner=owner, label_smoothing=eps)
    else:
        logits = vocab_parallel_logits(x, head.weight, ctx, owner=owner)
        loss = vocab_parallel_cross_entropy(logits, labels, ctx, vocab, label_smoothing=eps)
    (loss * up).sum().backward()
    return loss.detach(), x.grad, head.weight.grad


def _rel_errs(got, want):
    return {name: float((a.double() - b.double()).abs().max() / b.double().abs().max())
            for name, a, b in zip(("loss", "input grad", "weight grad"), got, want)}


@pytest.mark.parametrize("vocab,eps,tied", CASES)
def test_fused_matches_fp64_and_unfused(vocab, eps, tied):
    truth = _run("fp64", vocab, eps, tied)
    got, unfused = _run("fused", vocab, eps, tied), _run("unfused", vocab, eps, tied)
    for name, err in _rel_errs(got, truth).items():
        assert err <= 2e-6, f"fused {name}: rel err {err:.2e} against fp64"
    for name, err in _rel_errs(unfused, truth).items():
        assert err <= 5e-6, f"unfused {name}: rel err {err:.2e} against fp64"
    assert torch.equal(got[0][0], torch.zeros(3)), "ignored rows must have zero loss"
    assert torch.count_nonzero(got[2][vocab:]) == 0, "padded weight rows must get exactly zero grad"


def _tp_rank(vocab, sp, tied):
    """At TP=2 (SP on or off): fused and unfused losses and grads of this rank, and the fp64 truth
    from the full weight and hidden states (all-gathered) for this rank's part."""
    ctx = ParallelContext.build(tp=2)
    r = ctx.tp.rank
    head = _head(vocab, ctx)
    full_x, labels, up = _data(vocab)
    x_local = full_x[r * 3:(r + 1) * 3] if sp else full_x
    shards = [torch.empty_like(head.weight) for _ in range(2)]
    dist.all_gather(shards, head.weight.detach())
    owner = None if tied else head
    out = {}
    for mode in ("fused", "unfused"):
        head.weight.grad = None
        head.weight.meta.main_grad = None if tied else torch.zeros_like(head.weight)
        x = x_local.clone().requires_grad_(True)
        if mode == "fused":
            loss = fused_linear_cross_entropy(x, head.weight, labels, ctx, vocab, sequence_parallel=sp, owner=owner)
        else:
            logits = vocab_parallel_logits(x, head.weight, ctx, sequence_parallel=sp, owner=owner)
            loss = vocab_parallel_cross_entropy(logits, labels, ctx, vocab)
        (loss * up).sum().backward()
        wgrad = head.weight.grad if tied else head.weight.meta.main_grad
        out[mode] = (loss.detach(), x.grad, wgrad.clone())
    xd, wd = full_x.double().requires_grad_(True), torch.cat(shards).double().requires_grad_(True)
    ref = F.cross_entropy((xd @ wd.t())[..., :vocab].reshape(-1, vocab), labels.reshape(-1),
                          reduction="none").view(labels.shape)
    (ref * up.double()).sum().backward()
    rows = head.weight.shape[0]
    out["fp64"] = (ref.detach(), xd.grad[r * 3:(r + 1) * 3] if sp else xd.grad, wd.grad[r * rows:(r + 1) * rows])
    return out


@pytest.mark.parametrize("sp,tied", [(False, False), (True, False), (True, True)])
def test_fused_matches_unfused_and_fp64_at_tp2(sp, tied):
    """TP=2: the fused path's vocab-parallel statistics are the unfused path's operations, so the
    losses agree bitwise; grads within fp32 rounding of each other and of fp64 (2e-6 relative)."""
    for rank, out in enumerate(run_ranks(_tp_rank, 2, 250, sp, tied, timeout=120)):
        assert torch.equal(out["fused"][0], out["unfused"][0]), f"rank {rank}: losses differ"
        for name, err in _rel_errs(out["fused"], out["fp64"]).items():
            assert err <= 2e-6, f"rank {rank} fused {name}: rel err {err:.2e} against fp64"
        for name, err in _rel_errs(out["unfused"], out["fp64"]).items():
            assert err <= 5e-6, f"rank {rank} unfused {name}: rel err {err:.2e} against fp64"
