"""All2all context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023, section 3) as one autograd
function, so that the attention output is kept once.

Composed from differentiable pieces (all-to-all, SDPA, all-to-all back), the step keeps the output
twice: SDPA saves its head-sharded output ``[s, b, n/C, d]`` for its backward, and the output
projection saves the sequence-sharded copy ``[s/C, b, n, d]`` the second all-to-all returns: the
same values in two layouts, ``s/C · b · n · d`` elements per layer and microbatch. Here only the
sequence-sharded copy (the one the projection keeps anyway, as a view of the same storage) is
saved; the backward rebuilds the head-sharded output from it with the all-to-all that moves the
output's grad, made twice as wide (``[.., 2d]``), so the backward issues as many collectives as
before, with the output's bytes added.

The attention itself is the fused block kernel of :mod:`.kernels` (the CPU flash kernel, which
returns the log-sum-exp its backward needs), over the whole gathered sequence in one block.
"""

from __future__ import annotations

import torch

from paratron.parallel.comm import Group
from paratron.parallel.mappings import all_to_all_heads_to_seq, all_to_all_seq_to_heads

from .kernels import block_backward, block_forward


class UlyssesAttention(torch.autograd.Function):
    """Causal attention of ``C`` ranks' contiguous sequence shards, heads exchanged by all-to-all.

    Forward ``(q [s/C, b, n_q, d], k, v [s/C, b, n_kv, d], group, scale)`` -> ``[s/C, b, n_q, d]``
    in ``q``'s dtype (the softmax in fp32). ``n_q`` and ``n_kv`` must divide by ``group.size``
    (the caller checks). Saved: the head-sharded ``q``, ``k``, ``v`` (as SDPA would), the
    ``[s, b, n_q/C]`` fp32 log-sum-exp and the returned output.
    """

    @staticmethod
    def forward(fctx, q, k, v, group: Group, scale: float):
        # Autograd is off inside forward, so the differentiable exchanges just move data here.
        qh, kh, vh = (all_to_all_seq_to_heads(t, group) for t in (q, k, v))
        out, lse = block_forward(qh, kh, vh, True, scale)
        y = all_to_all_heads_to_seq(out.to(q.dtype), group)
        fctx.group, fctx.scale = group, scale
        fctx.save_for_backward(qh, kh, vh, lse, y)
        return y

    @staticmethod
    def backward(fctx, dy):
        qh, kh, vh, lse, y = fctx.saved_tensors
        d = y.shape[-1]
        # One exchange carries the output (to rebuild its head layout) and its grad.
        both = all_to_all_seq_to_heads(torch.cat((y, dy.to(y.dtype)), dim=-1), fctx.group)
        out_h, dout_h = both[..., :d], both[..., d:]
        grads = block_backward(qh, kh, vh, out_h, lse, dout_h, True, fctx.scale)
        dq, dk, dv = (all_to_all_heads_to_seq(g.to(t.dtype), fctx.group) for g, t in zip(grads, (qh, kh, vh)))
        return dq, dk, dv, None, None
