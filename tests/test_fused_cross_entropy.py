"""The fused output-layer GEMM + cross-entropy (``fused_linear_cross_entropy``) at TP=1 against
a float64 ground truth (``F.cross_entropy`` of the fp64 logits over the true vocab) and the
unfused composition ``vocab_parallel_cross_entropy(vocab_parallel_logits(...))``: the same
per-token losses and input / weight grads within fp32 rounding (2e-6 of the largest magnitude
against fp64; the unfused path, whose backward exponentiates ``log p``, is checked against the
same truth at 5e-6), with a padded vocab, label smoothing, ``ignore_index`` rows, per-token
upstream grads, a tied (autograd) and an untied (main-grad path) weight; padded weight rows get
exactly zero grad and ignored rows contribute nothing."""

import pytest
import torch
import torch.nn.functional as F

from paratron.layers import ParallelLMHead, vocab_parallel_cross_entropy, vocab_parallel_logits
from paratron.layers.cross_entropy import fused_linear_cross_entropy
from paratron.parallel.context import ParallelContext

CASES = [(v, eps, tied) for v in (250, 256) for eps in (0.0, 0.1) for tied in (False, True)]


def _inputs(vocab):
    ctx = ParallelContext.single()
    head = ParallelLMHead(vocab, 16, ctx, logical_name="o", seed=1, make_vocab_size_divisible_by=128)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, 16, generator=g) * 3
    labels = torch.randint(0, vocab, (6, 3), generator=g)
    labels[0] = -100
    labels[2, 1] = vocab - 1
    return ctx, head, x, labels, torch.randn(6, 3, generator=g)


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
