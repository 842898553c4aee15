"""The hand-written backwards of the eager elementwise paths (fp32 RMSNorm, RoPE, SwiGLU) against
autograd through their composite forms: ``gradcheck`` in fp64, and the module paths in fp32."""

import torch

from paratron.layers.norm import _RMSNormFn
from paratron.models.mlp import _SwiGLUFn, activate, swiglu
from paratron.models.rope import _Rope, _rotate_half, apply_rope, rope_tables_at


def _tables(s, b, d, dtype):
    pos = torch.arange(s).view(s, 1).expand(s, b)
    cos, sin = rope_tables_at(pos, d, 10000.0)
    return cos.to(dtype), sin.to(dtype)


def test_rmsnorm_function_gradcheck_fp64():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, 1e-5), (x, w))


def test_rmsnorm_function_matches_the_composite_form_fp32():
    torch.manual_seed(0)
    x = torch.randn(16, 4, 64, requires_grad=True)
    w = (1 + 0.1 * torch.randn(64)).requires_grad_()
    dy = torch.randn(16, 4, 64)
    got = _RMSNormFn.apply(x, w, 1e-5)
    gx, gw = torch.autograd.grad(got, (x, w), dy)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    rx, rw = torch.autograd.grad(ref, (x, w), dy)
    for a, b in ((got, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rope_function_gradcheck_fp64():
    torch.manual_seed(0)
    cos, sin = _tables(6, 2, 8, torch.float64)
    x = torch.randn(6, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: _Rope.apply(a, cos, sin), (x,))


def test_rope_eager_path_matches_the_composite_form_fp32():
    torch.manual_seed(0)
    cos, sin = _tables(12, 2, 16, torch.float32)
    x = torch.randn(12, 2, 4, 16, requires_grad=True)
    dy = torch.randn(12, 2, 4, 16)
    got = apply_rope(x, cos, sin)
    ref = x * cos + _rotate_half(x) * sin
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(got, x, dy)[0], torch.autograd.grad(ref, x, dy)[0],
                               rtol=1e-6, atol=1e-6)


def test_swiglu_function_gradcheck_fp64():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 12, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SwiGLUFn.apply, (x,))


def test_swiglu_eager_path_equals_the_composite_form_bitwise():
    # The same kernels in the same order, so equal bit for bit in every dtype, grads included.
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(12, 2, 2 * 24, dtype=dtype, requires_grad=True)
        dy = torch.randn(12, 2, 24, dtype=dtype)
        got = activate("swiglu", x)
        ref = swiglu(*x.chunk(2, dim=-1))
        assert torch.equal(got, ref)
        assert torch.equal(torch.autograd.grad(got, x, dy)[0], torch.autograd.grad(ref, x, dy)[0])
