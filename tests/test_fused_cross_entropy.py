"""The fused output-layer GEMM + cross-entropy (``fused_linear_cross_entropy``) against the
unfused composition ``vocab_parallel_cross_entropy(vocab_parallel_logits(...))`` at TP=1: the
same per-token losses and input / weight grads within fp32 rounding (1e-6 relative to the
largest magnitude), with a padded vocab, label smoothing, ``ignore_index`` rows, per-token
upstream grads, a tied (autograd) and an untied (main-grad path) weight; padded weight rows get
exactly zero grad and ignored rows contribute nothing."""

import pytest
import torch

from paratron.layers import ParallelLMHead, vocab_parallel_cross_entropy, vocab_parallel_logits
from paratron.layers.cross_entropy import fused_linear_cross_entropy
from paratron.parallel.context import ParallelContext

CASES = [(v, eps, tied) for v in (250, 256) for eps in (0.0, 0.1) for tied in (False, True)]


def _run(fused, vocab, eps, tied):
    ctx = ParallelContext.single()
    head = ParallelLMHead(vocab, 16, ctx, logical_name="o", seed=1, make_vocab_size_divisible_by=128)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 3, 16, generator=g) * 3).requires_grad_(True)
    labels = torch.randint(0, vocab, (6, 3), generator=g)
    labels[0] = -100
    labels[2, 1] = vocab - 1
    up = torch.randn(6, 3, generator=g)
    owner = None if tied else head
    if fused:
        loss = fused_linear_cross_entropy(x, head.weight, labels, ctx, vocab, owner=owner, label_smoothing=eps)
    else:
        logits = vocab_parallel_logits(x, head.weight, ctx, owner=owner)
        loss = vocab_parallel_cross_entropy(logits, labels, ctx, vocab, label_smoothing=eps)
    (loss * up).sum().backward()
    return loss.detach(), x.grad, head.weight.grad


@pytest.mark.parametrize("vocab,eps,tied", CASES)
def test_fused_matches_unfused(vocab, eps, tied):
    want, got = _run(False, vocab, eps, tied), _run(True, vocab, eps, tied)
    for name, a, b in zip(("loss", "input grad", "weight grad"), got, want):
        err = (a.double() - b.double()).abs().max() / b.double().abs().max()
        assert err <= 1e-6, f"{name}: rel err {err:.2e}"
    assert torch.equal(got[0][0], torch.zeros(3)), "ignored rows must have zero loss"
    assert torch.count_nonzero(got[2][vocab:]) == 0, "padded weight rows must get exactly zero grad"
