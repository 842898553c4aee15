"""Grouped expert GEMMs against the per-expert loop (fp32, tolerance 1e-6), forward and backward,
with experts that receive zero rows."""

from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.models.moe.experts import LocalExperts
from paratron.models.moe.grouped_gemm import choose_method, grouped_linear
from paratron.parallel.context import ParallelContext
from paratron.pipeline.chunk import attach_weight_grad_stores

TOL = dict(rtol=1e-6, atol=1e-6)
COUNTS = [3, 0, 5, 0, 1, 7]  # experts 1 and 3 get no rows


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


@pytest.mark.parametrize("method", ["grouped_mm", "bmm", "loop"])
def test_grouped_linear_matches_per_expert_matmuls(method):
    x = _rows(sum(COUNTS), 8, 0).requires_grad_()
    w = _rows(len(COUNTS) * 8, 12, 1).view(len(COUNTS), 8, 12).requires_grad_()
    g = _rows(sum(COUNTS), 12, 2)
    y = grouped_linear(x, w, COUNTS, method)
    (y * g).sum().backward()
    xs, gs = torch.split(x.detach(), COUNTS), torch.split(g, COUNTS)
    torch.testing.assert_close(y, torch.cat([a @ w[e].detach() for e, a in enumerate(xs)]), **TOL)
    torch.testing.assert_close(x.grad, torch.cat([b @ w[e].detach().t() for e, b in enumerate(gs)]), **TOL)
    want_w = torch.stack([a.t() @ b for a, b in zip(xs, gs)])
    torch.testing.assert_close(w.grad, want_w, **TOL)
    assert w.grad[1].abs().max() == 0 and w.grad[3].abs().max() == 0


def test_grouped_mm_accepts_broadcast_grads_and_auto_choice():
    x = _rows(16, 8, 0).requires_grad_()
    w = _rows(4 * 8, 4, 1).view(4, 8, 4).requires_grad_()
    grouped_linear(x, w, [4, 4, 0, 8], "grouped_mm").sum().backward()  # stride-0 grad from .sum()
    assert x.grad is not None and w.grad[2].abs().max() == 0
    assert choose_method(x, w, [4, 4, 0, 8]) == "grouped_mm"
    odd = torch.zeros(3, 5, 3)  # 5 * 4 bytes is not 16-byte aligned
    assert choose_method(torch.zeros(6, 5), odd, [2, 2, 2]) == "bmm"
    assert choose_method(torch.zeros(9, 5), odd, [9, 0, 0]) == "loop"  # 27 padded rows for 9
    with pytest.raises(ValueError, match="does not apply"):
        grouped_linear(torch.zeros(6, 5), odd, [2, 2, 2], "grouped_mm")
    with pytest.raises(ValueError, match="do not match"):
        grouped_linear(torch.zeros(6, 5), odd, [2, 2], "loop")


def _experts(activation: str, bias: bool, gemm: str) -> LocalExperts:
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                      seq_length=8, num_experts=len(COUNTS), moe_top_k=2, moe_ffn_hidden_size=24,
                      activation=activation, add_bias_linear=bias)
    return LocalExperts(cfg, ParallelContext.single(), prefix="layers.0.mlp", seed=3, first_expert=0,
                        num_local=len(COUNTS), params_dtype=torch.float32, gemm=gemm)


@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("gelu", True)])
@pytest.mark.parametrize("gemm", ["auto", "grouped_mm", "bmm", "loop"])
def test_local_experts_match_per_expert_loop(activation, bias, gemm):
    experts = _experts(activation, bias, gemm)
    with torch.no_grad():  # non-zero biases, so a misplaced bias row shows
        for p in experts.parameters():
            if p.dim() == 1:
                p.copy_(_rows(1, p.numel(), p.numel()).view(-1))
    x = _rows(sum(COUNTS), 16, 4).requires_grad_()
    probe = _rows(sum(COUNTS), 16, 5)
    (experts(x, COUNTS) * probe).sum().backward()
    y = experts(x, COUNTS).detach()
    got = {n: p.grad.clone() for n, p in experts.named_parameters()}
    gx = x.grad.clone()
    experts.zero_grad(set_to_none=True)
    x.grad = None
    ref = torch.cat([e(part) for e, part in zip(experts.local, torch.split(x, COUNTS))])
    (ref * probe).sum().backward()
    torch.testing.assert_close(y, ref.detach(), **TOL)
    torch.testing.assert_close(gx, x.grad, **TOL)
    for n, p in experts.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **TOL, msg=lambda m: f"grad {n}: {m}")
        if n.startswith(("local.1.", "local.3.")):
            assert got[n].abs().max() == 0, n


@pytest.mark.parametrize("activation,gemm", [("swiglu", "grouped_mm"), ("gelu", "bmm"), ("gelu", "loop")])
def test_local_experts_defer_weight_grads_to_w(activation, gemm):
    """With the zero-bubble store deferring (a B action), no expert weight or bias gets a grad in
    the backward; one flush (the W action) gives each the grad of a plain backward, bitwise, zero
    for the experts without rows."""
    experts = _experts(activation, True, gemm)
    x, probe = _rows(sum(COUNTS), 16, 4).requires_grad_(), _rows(sum(COUNTS), 16, 5)
    (experts(x, COUNTS) * probe).sum().backward()
    want = {n: p.grad for n, p in experts.named_parameters()}
    experts.zero_grad(set_to_none=True)
    (store,) = attach_weight_grad_stores([experts])
    store.deferring = True
    (experts(x, COUNTS) * probe).sum().backward()
    store.deferring = False
    store.mark()
    assert all(experts.get_parameter(n).grad is None for n in want), "a grad was not deferred"
    store.flush()
    store.assert_empty()
    for n, g in want.items():
        assert torch.equal(experts.get_parameter(n).grad, g), n
    assert not want["local.1.fc2.weight" if activation == "gelu" else "local.1.up.weight"].any()
