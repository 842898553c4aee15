"""Rotary position embeddings (Su et al. 2021, "RoFormer", section 3.4).

Convention: the *half-split* ("rotate_half") layout used by Llama's Hugging Face port and
Megatron-LM's default: a head vector ``x = [x1, x2]`` (two halves of ``d/2``) at position ``p``
becomes ``x * cos + [-x2, x1] * sin`` with ``cos = cos([p * f, p * f])`` and
``f_i = theta^(-2i/d)``. Because paratron uses the same layout as Hugging Face, Llama q/k weights
convert without a permutation.
"""

from __future__ import annotations

import torch


def rope_tables(seq_len: int, dim: int, theta: float, device=None, offset: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for positions ``offset .. offset+seq_len-1``.

    Args:
        seq_len: number of positions s.
        dim: head dim d (even).
        theta: the RoPE base (``model.rope_theta``).
    Returns:
        ``(cos, sin)``, each fp32 ``[s, 1, 1, d]`` (broadcasts over ``[s, b, heads, d]``).
    Raises:
        ValueError: ``dim`` is odd.
    """
    pos = torch.arange(offset, offset + seq_len, dtype=torch.int64, device=device)
    return rope_tables_at(pos[:, None], dim, theta)


def rope_tables_at(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for arbitrary positions: global positions of a context-parallel rank's
    tokens, or positions that restart at each packed document.

    Args:
        positions: ``[s, b]`` (or ``[s, 1]``) int64 positions.
    Returns:
        ``(cos, sin)``, each fp32 ``[s, b, 1, d]``.
    Raises:
        ValueError: ``dim`` is odd.
    """
    if dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got {dim}")
    # Same arithmetic as the Hugging Face Llama port (fp32 arange, elementwise product), so the
    # tables agree bit for bit with it.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=positions.device) / dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``out = x * cos + [-x2, x1] * sin`` half by half, written in place: two products and two
    ``addcmul`` passes over halves, no rotated copy and no concatenation."""
    h = x.shape[-1] // 2
    (x1, x2), (o1, o2) = (x[..., :h], x[..., h:]), (out[..., :h], out[..., h:])
    torch.mul(x1, cos[..., :h], out=o1)
    o1.addcmul_(x2, sin[..., :h], value=-1.0)
    torch.mul(x2, cos[..., h:], out=o2)
    o2.addcmul_(x1, sin[..., h:])
    return out


class _Rope(torch.autograd.Function):
    """RoPE as one rotation forward and its transpose backward; keeps only the tables (the
    composite form keeps a rotated copy of ``x`` for the backward of its products)."""

    @staticmethod
    def forward(fctx, x, cos, sin):
        fctx.save_for_backward(cos, sin)
        return _rotate_into(torch.empty_like(x, memory_format=torch.contiguous_format), x, cos, sin)

    @staticmethod
    def backward(fctx, dy):
        cos, sin = fctx.saved_tensors
        # The transpose of [[c1, -s1], [s2, c2]] per channel pair: dx1 = dy1 c1 + dy2 s2,
        # dx2 = dy2 c2 - dy1 s1.
        h = dy.shape[-1] // 2
        dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
        (dy1, dy2), (d1, d2) = (dy[..., :h], dy[..., h:]), (dx[..., :h], dx[..., h:])
        torch.mul(dy1, cos[..., :h], out=d1)
        d1.addcmul_(dy2, sin[..., h:])
        torch.mul(dy2, cos[..., h:], out=d2)
        d2.addcmul_(dy1, sin[..., :h], value=-1.0)
        return dx, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[s, b, heads, d]`` by the tables of :func:`rope_tables` (cast to x's dtype).

    Eager: :class:`_Rope`, fewer passes over ``x`` than the composite form; under
    ``torch.compile`` (``model.compile``) or with tables that need a grad, the composite form,
    which the compiler fuses itself."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if torch.compiler.is_compiling() or cos.requires_grad or sin.requires_grad:
        return x * cos + _rotate_half(x) * sin
    return _Rope.apply(x, cos, sin)
