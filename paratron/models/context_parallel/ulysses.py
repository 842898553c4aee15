"""All-to-all context parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses", section 3): an
all-to-all over the CP group turns the sequence-sharded ``q, k, v`` ``[s/C, b, n, d]`` into
head-sharded ``[s, b, n/C, d]``; attention runs over the whole sequence for ``n/C`` heads; a second
all-to-all turns the output back. Each rank holds a contiguous ``s / C`` (the ``all2all`` split of
:mod:`.layout`), so the gathered sequence is in natural order.

Heads are cut in ``C`` contiguous parts; with grouped-query attention the query groups must divide
by ``C`` (after TP: ``num_query_groups % (C * TP) == 0``) so that every part holds whole groups.
"""

from __future__ import annotations

import torch


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    s, b, n, d = x.shape
    c = group.size
    send = x.reshape(s, b, c, n // c, d).permute(2, 0, 1, 3, 4).contiguous()  # [C, s/C, b, n/C, d]
    recv = torch.empty_like(send)
    group.all_to_all(recv, send)                                                # recv[p]: rank p's tokens
    return recv.reshape(c * s, b, n // c, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    s_full, b, n_part, d = x.shape
    c = group.size
    send = x.reshape(c, s_full // c, b, n_part, d).contiguous()                 # send[p]: rank p's tokens
    recv = torch.empty_like(send)
    group.all_to_all(recv, send)                                                # recv[p]: head part p
    return recv.permute(1, 2, 0, 3, 4).reshape(s_full // c, b, c * n_part, d)


class SeqToHeads(torch.autograd.Function):
    """``[s/C, b, n, d]`` (sequence shards) -> ``[s, b, n/C, d]`` (head shards); backward is the
    inverse all-to-all."""

    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(fctx, g):
        return _heads_to_seq(g.contiguous(), fctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """``[s, b, n/C, d]`` -> ``[s/C, b, n, d]``; backward is the inverse all-to-all."""

    @staticmethod
    def forward(fctx, x, group):
        fctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(fctx, g):
        return _seq_to_heads(g.contiguous(), fctx.group), None
