"""Attention on one block of queries against one block of keys, returning the log-sum-exp, and
its backward, in fp32: the building block of ring attention (Liu et al. 2023, "Ring Attention with
Blockwise Transformers", section 3) and of per-document attention.

Partial results over several key blocks are merged with their log-sum-exps (Milakov & Gimelshein
2018, "Online normalizer calculation for softmax"; Dao et al. 2022, FlashAttention, section 3.1):
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)``. The
backward uses the final ``out`` and ``lse`` of each query row (FlashAttention's algorithm 2):
``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P (dO V^T - rowsum(dO * O))``, ``dQ = dS K scale``,
``dK = dS^T Q scale``.

Layouts: ``q`` ``[sq, b, n_q, d]``, ``k``/``v`` ``[sk, b, n_kv, d]`` (grouped-query: query head
``j * (n_q / n_kv) + r`` reads key head ``j``), ``out`` ``[sq, b, n_q, d]``, ``lse`` ``[sq, b, n_q]``.

Two implementations of the same formulas: on CPU, PyTorch's fused flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which return and take the
log-sum-exp; its backward given the *final* ``out``/``lse`` gives exactly one block's share, the
trick ring flash-attention implementations use), and elsewhere a plain fp32 matmul version
(``*_math``), which is also the reference the tests hold the fused one to.
"""

from __future__ import annotations

import torch


def _expand(kv: torch.Tensor, n_q: int) -> torch.Tensor:
    r = n_q // kv.shape[2]
    return kv.float() if r == 1 else kv.float().repeat_interleave(r, dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """``[b, n, sq, sk]`` fp32 scores, the upper triangle at -inf when ``causal``."""
    s = torch.einsum("ibnd,jbnd->bnij", q.float(), _expand(k, q.shape[2])) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _fused(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _bnsd(t: torch.Tensor) -> torch.Tensor:
    return t.permute(1, 2, 0, 3)


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [sq, b, n_q, d], lse [sq, b, n_q])``, both fp32, of softmax attention of ``q`` over
    ``k``/``v`` (``causal``: row ``i`` sees keys ``0..i``; needs ``sq == sk``)."""
    if not _fused(q):
        return block_forward_math(q, k, v, causal, scale)
    # fp32 inside whatever the input dtype: partial outputs are merged, so they are not rounded.
    n_q = q.shape[2]
    kx, vx = (_expand(t, n_q) for t in (k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bnsd(q.float()), _bnsd(kx), _bnsd(vx), 0.0, causal, scale=scale)
    return out.permute(2, 0, 1, 3).float(), lse.permute(2, 0, 1).float()


def block_backward(q, k, v, out, lse, dout, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grads ``(dq [sq, b, n_q, d], dk, dv [sk, b, n_kv, d])`` in fp32 of one block.

    Args:
        out: the *final* ``[sq, b, n_q, d]`` output of the query rows (over every key block).
        lse: their final ``[sq, b, n_q]`` log-sum-exp.
        dout: ``[sq, b, n_q, d]`` grad of the final output.
    """
    if not _fused(q):
        delta = (dout.float() * out.float()).sum(-1)
        return block_backward_math(q, k, v, lse, dout, delta, causal, scale)
    n_q, n_kv = q.shape[2], k.shape[2]
    kx, vx = (_expand(t, n_q) for t in (k, v))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bnsd(dout.float()), _bnsd(q.float()), _bnsd(kx), _bnsd(vx), _bnsd(out.float()),
        lse.permute(1, 2, 0).contiguous(), 0.0, causal, scale=scale)
    dq, dk, dv = (t.permute(2, 0, 1, 3).float() for t in (dq, dk, dv))
    if n_q != n_kv:
        sk, b, _, d = dk.shape
        dk = dk.reshape(sk, b, n_kv, n_q // n_kv, d).sum(3)
        dv = dv.reshape(sk, b, n_kv, n_q // n_kv, d).sum(3)
    return dq, dk, dv


def block_forward_math(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_forward` in plain fp32 matmuls."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.einsum("bnij,jbnd->ibnd", p, _expand(v, q.shape[2]))
    return out, lse.permute(2, 0, 1)


def block_backward_math(q, k, v, lse, dout, delta, causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`block_backward` in plain fp32 matmuls; ``delta`` ``[sq, b, n_q]`` is
    ``rowsum(dout * out)`` of the final output."""
    n_q, n_kv = q.shape[2], k.shape[2]
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.permute(1, 2, 0).unsqueeze(-1))
    dout = dout.float()
    dv = torch.einsum("bnij,ibnd->jbnd", p, dout)
    dp = torch.einsum("ibnd,jbnd->bnij", dout, _expand(v, n_q))
    ds = p * (dp - delta.permute(1, 2, 0).unsqueeze(-1))
    dq = torch.einsum("bnij,jbnd->ibnd", ds, _expand(k, n_q)) * scale
    dk = torch.einsum("bnij,ibnd->jbnd", ds, q.float()) * scale
    if n_q != n_kv:
        sk, b, _, d = dk.shape
        dk = dk.view(sk, b, n_kv, n_q // n_kv, d).sum(3)
        dv = dv.view(sk, b, n_kv, n_q // n_kv, d).sum(3)
    return dq, dk, dv


def merge_(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial result into the running ``(out, lse)`` in place (rows not seen yet hold
    ``lse = -inf`` and ``out = 0``)."""
    new = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(part_out * torch.exp(part_lse - new).unsqueeze(-1))
    lse.copy_(new)
