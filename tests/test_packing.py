"""Packed documents (``data.reset_position_ids``, ``reset_attention_mask``, ``eod_mask_loss``):
a packed sample gives every token the loss it gets when its document runs alone, and the same
grads, on one process and under CP=2 (ring and all2all) with a document boundary inside a CP
chunk, a document across two chunks and a boundary on a chunk edge. fp32, 1e-5 relative.
"""

from __future__ import annotations

import torch

from paratron.config import ModelConfig
from paratron.data.packing import document_starts, pack_microbatch, reset_positions
from paratron.models.context_parallel import shard_microbatch
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

EOD, VOCAB, SEQ, SEED = 1, 32, 24, 7
# Sample 0: documents [0, 9), [9, 18), [18, 24): with CP=2 the ring's chunks are [0,6) [6,12)
# [12,18) [18,24): a boundary inside chunk 1, a document over chunks 1 and 2, a boundary on the
# edge of chunks 2 and 3. Sample 1: [0, 5) and [5, 24).
DOCS = ([9, 9, 6], [5, 19])


def _model_cfg(rope: bool) -> ModelConfig:
    if rope:
        return ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                           vocab_size=VOCAB, seq_length=SEQ, normalization="rmsnorm",
                           position_embedding_type="rope", activation="swiglu", add_bias_linear=False,
                           make_vocab_size_divisible_by=8)
    return ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ,
                       make_vocab_size_divisible_by=8)


def _packed_batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, VOCAB, (len(DOCS), SEQ), generator=g)
    for row, lengths in enumerate(DOCS):
        ends = torch.tensor(lengths).cumsum(0)
        tokens[row, ends[:-1] - 1] = EOD  # every document but the window's last ends with EOD
    labels = torch.randint(2, VOCAB, (len(DOCS), SEQ), generator=g)
    return pack_microbatch({"tokens": tokens, "labels": labels}, EOD, reset_position_ids=True,
                           reset_attention_mask=True)


def _reference(rope: bool):
    """Each document run alone: per-token losses [b, s] and the grads of the sum of all losses."""
    (model,) = build_model_chunks(_model_cfg(rope), ParallelContext.single(), seed=SEED)
    mb = _packed_batch()
    losses = torch.zeros(len(DOCS), SEQ)
    for row, lengths in enumerate(DOCS):
        start = 0
        for n in lengths:
            part = model(mb["tokens"][row:row + 1, start:start + n], mb["labels"][row:row + 1, start:start + n])
            part.sum().backward()
            losses[row, start:start + n] = part[:, 0].detach()
            start += n
    return losses, {p.meta.logical_name: p.grad.clone() for p in model.parameters()}


def _packed_run(rope: bool, algorithm: str, ctx):
    """The packed batch on this rank's CP chunks: (global positions, losses [b, s/C], grads summed over CP)."""
    (model,) = build_model_chunks(_model_cfg(rope), ctx, seed=SEED, context_algorithm=algorithm)
    mb = shard_microbatch(_packed_batch(), ctx.cp.rank, ctx.cp.size, algorithm)
    losses = model(mb["tokens"], mb["labels"], position_ids=mb["position_ids"], cu_seqlens=mb["cu_seqlens"])
    losses.sum().backward()
    grads = {}
    for p in model.parameters():
        g = p.grad.clone()
        ctx.cp.all_reduce(g)
        grads[p.meta.logical_name] = g
    pos = shard_microbatch({"tokens": torch.arange(SEQ).expand(len(DOCS), -1)}, ctx.cp.rank, ctx.cp.size,
                           algorithm)["tokens"]
    return pos, losses.t().detach(), grads


def _check(pos, losses, grads, ref_losses, ref_grads, where):
    torch.testing.assert_close(losses, ref_losses.gather(1, pos), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{where}: per-token losses: {m}")
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: grad {n}: {m}")


def test_packed_equals_documents_alone_one_process():
    """One process, RoPE and learned positions: packed per-token losses and grads = each document alone."""
    for rope in (True, False):
        ref_losses, ref_grads = _reference(rope)
        _check(*_packed_run(rope, "ring", ParallelContext.single()), ref_losses, ref_grads, f"rope={rope}")


def _cp_rank():
    out = []
    for algorithm in ("ring", "all2all"):
        ctx = ParallelContext.build(cp=2)
        out.append(_packed_run(True, algorithm, ctx))
    return out


def test_packed_equals_documents_alone_cp2():
    """CP=2, ring and all2all: boundaries inside a chunk, on a chunk edge, a document over two chunks."""
    ref_losses, ref_grads = _reference(True)
    for rank_out in run_ranks(_cp_rank, 2, timeout=120):
        for algorithm, res in zip(("ring", "all2all"), rank_out):
            _check(*res, ref_losses, ref_grads, f"cp=2 {algorithm}")


def test_document_fields():
    """cu_seqlens, restarting positions and the EOD loss mask follow Megatron's convention (the
    EOD token closes its document; no loss where the input is EOD)."""
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, 8], [5, 5, 5, 5, 5, EOD]])
    cu = document_starts(tokens, EOD)
    assert cu.tolist() == [[0, 3, 5, 6], [0, 6, 6, 6]]
    assert reset_positions(cu, 6).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    mb = pack_microbatch({"tokens": tokens, "labels": tokens + 1}, EOD, eod_mask_loss=True)
    assert (mb["labels"] == -100).tolist() == (tokens == EOD).tolist()
    assert "cu_seqlens" not in mb and "position_ids" not in mb
