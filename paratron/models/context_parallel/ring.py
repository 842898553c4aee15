"""Ring attention over the context-parallel group (Liu et al. 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context", section 3; the same scheme as Megatron-LM's context
parallelism), also used with one rank for packed documents.

Forward, on CP rank ``r`` of ``C``: step ``t`` holds the K/V block of rank ``(r - t) mod C``; the
send of that block to rank ``r + 1`` and the receive of the next one from ``r - 1`` are started
(one batched p2p through :class:`~paratron.parallel.comm.Group`) before the block's attention is
computed, so they overlap it. Partial outputs are merged with their log-sum-exps in fp32
(:mod:`.kernels`). Sends: ``C - 1`` K blocks and ``C - 1`` V blocks per layer.

Backward runs the same ring again: each K/V block travels with its grad accumulators ``dK``/``dV``
(fp32); every rank adds its queries' contribution and passes block and grads on, and after ``C``
hops the grads are back on the block's owner. The next K/V block's transfer overlaps the current
block's compute. Sends: ``C - 1`` K and V blocks plus ``C`` dK and dV blocks per layer.

Saved for backward: this rank's ``q, k, v``, ``out`` and ``lse`` only (``O(s / C)``); received
blocks are not kept.
"""

from __future__ import annotations

import torch

from .kernels import block_backward, block_forward, merge_
from .layout import SeqLayout, pair_pieces


def _exchange(group, send: list[torch.Tensor], recv: list[torch.Tensor]):
    """Start sending ``send`` to the next CP rank and receiving ``recv`` from the previous one."""
    if group.size == 1 or not send:
        return []
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    ops = [group.p2p_op("send", t, nxt) for t in send] + [group.p2p_op("recv", t, prev) for t in recv]
    return group.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def _pieces(layout: SeqLayout, src: int):
    """(query row slice, key row slice, piece) of local queries against rank ``src``'s keys."""
    c, cu = layout.chunk_size, layout.cu_seqlens
    for qi, qj in enumerate(layout.chunks):
        for ki, kj in enumerate(layout.chunks_of(src)):
            for p in pair_pieces(qj * c, kj * c, c, cu):
                b = p.b if isinstance(p.b, slice) else slice(p.b, p.b + 1)
                q_rows = slice(qi * c + p.q.start, qi * c + p.q.stop)
                k_rows = slice(ki * c + p.k.start, ki * c + p.k.stop)
                yield q_rows, k_rows, b, p.causal


class RingAttention(torch.autograd.Function):
    """``out = softmax(q k^T scale, causal and per-document mask) v`` over the full sequence,
    with ``q, k, v`` this rank's tokens (:class:`~.layout.SeqLayout` order).

    ``apply(q [s/C, b, n_q, d], k, v [s/C, b, n_kv, d], layout, scale) -> [s/C, b, n_q, d]``.
    """

    @staticmethod
    def forward(fctx, q, k, v, layout: SeqLayout, scale: float):
        group = layout.cp
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        cur = [k.contiguous(), v.contiguous()]
        for t in range(group.size):
            nxt = [torch.empty_like(x) for x in cur] if t < group.size - 1 else []
            reqs = _exchange(group, cur if nxt else [], nxt)
            src = (group.rank - t) % group.size
            for qr, kr, b, causal in _pieces(layout, src):
                o, l_ = block_forward(q[qr, b], cur[0][kr, b], cur[1][kr, b], causal, scale)
                merge_(out[qr, b], lse[qr, b], o, l_)
            _wait(reqs)
            cur = nxt or cur
        fctx.layout, fctx.scale = layout, scale
        fctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(fctx, dout):
        q, k, v, out, lse = fctx.saved_tensors
        layout, scale, group = fctx.layout, fctx.scale, fctx.layout.cp
        dq = torch.zeros_like(out)
        cur = [k.contiguous(), v.contiguous()]
        grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
        for t in range(group.size):
            last = t == group.size - 1
            nxt = [] if last else [torch.empty_like(x) for x in cur]
            kv_reqs = _exchange(group, [] if last else cur, nxt)
            src = (group.rank - t) % group.size
            for qr, kr, b, causal in _pieces(layout, src):
                gq, gk, gv = block_backward(q[qr, b], cur[0][kr, b], cur[1][kr, b], out[qr, b], lse[qr, b],
                                            dout[qr, b], causal, scale)
                dq[qr, b] += gq
                grads[0][kr, b] += gk
                grads[1][kr, b] += gv
            # Pass this block's grads on; the previous rank's block grads arrive (after C hops a
            # block's grads are home).
            incoming = [torch.empty_like(g) for g in grads]
            _wait(_exchange(group, grads, incoming))
            _wait(kv_reqs)
            grads = incoming if group.size > 1 else grads
            cur = nxt or cur
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None
