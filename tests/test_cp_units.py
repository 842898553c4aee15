"""Context parallelism: config errors before launch, the load balance of the ring's split, the
ring's communication against the analytic count, and the activation memory per rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratron.config import Config, ConfigError, ModelConfig
from paratron.rules import validate
from paratron.models.context_parallel import attention_flops_per_rank
from paratron.models.context_parallel.ulysses import UlyssesAttention
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.parallel.mappings import all_to_all_seq_to_heads
from paratron.local_ranks import run_ranks

from helpers import config_with


def _cfg(**kw) -> Config:
    return config_with(**{"model__seq_length": 64, "model__num_attention_heads": 4, "model__hidden_size": 64, **kw})


@pytest.mark.parametrize("kw, words", [
    (dict(parallel__context=4, model__seq_length=36), ["model.seq_length=36", "2*parallel.context=8", "2C chunks"]),
    (dict(parallel__context=8, parallel__context_algorithm="all2all", model__seq_length=36),
     ["model.seq_length=36", "parallel.context=8"]),
    (dict(parallel__context=2, parallel__tensor=4, parallel__context_algorithm="all2all"),
     ["model.num_query_groups=4", "parallel.context*parallel.tensor = 2*4"]),
    (dict(parallel__context=2, parallel__tensor=4, parallel__sequence_parallel=True, model__seq_length=12),
     ["tokens per CP rank", "parallel.tensor=4"]),
    (dict(parallel__context=2, model__attention_dropout=0.1), ["model.attention_dropout=0.1", "parallel.context"]),
    (dict(data__reset_attention_mask=True, model__attention_dropout=0.1), ["data.reset_attention_mask"]),
    (dict(parallel__context=2, parallel__context_algorithm="ulysses"), ["parallel.context_algorithm='ulysses'"]),
])
def test_config_errors_name_fields_and_rule(kw, words):
    with pytest.raises(ConfigError) as e:
        validate(_cfg(**kw))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_cp_layouts_validate_and_info_shows_cp_groups():
    validate(_cfg(parallel__context=4), 8)
    validate(_cfg(parallel__context=2, parallel__context_algorithm="all2all", parallel__tensor=2), 8)
    from paratron.launch.info import _describe_grid

    grid = _describe_grid(_cfg(parallel__context=2, parallel__tensor=2), 8)
    assert grid["groups"]["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]] and grid["dp"] == 2


def test_balanced_split_evens_attention_flops():
    """C=4, counted by block as the ring runs them: the balanced split is within 1% across ranks
    (here exactly even); the naive contiguous split gives the last rank 7x the first's work."""
    for s in (64, 4096):
        balanced = attention_flops_per_rank(s, 4, "ring", heads=4, head_dim=16)
        assert max(balanced) / min(balanced) - 1 <= 0.01, balanced
        naive = attention_flops_per_rank(s, 4, "naive", heads=4, head_dim=16)
        assert max(naive) / min(naive) > 6, naive
        assert sum(naive) == sum(balanced)  # the same causal work, only placed differently
    docs = torch.tensor([[0, 10, 40, 64]])  # with packed documents the count is still by block
    assert sum(attention_flops_per_rank(64, 2, "ring", cu_seqlens=docs)) < sum(attention_flops_per_rank(64, 2, "ring"))


# ---- ledger and memory (4 ranks) ---------------------------------------------------------------

def _model_cfg(seq: int) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, vocab_size=32,
                       seq_length=seq, position_embedding_type="rope", make_vocab_size_divisible_by=8)


def _ring_bytes(C: int):
    """cp p2p bytes per layer, forward and backward, of a 2-layer model at s=32, b=2 (fp32)."""
    ctx = ParallelContext.build(cp=C)
    (model,) = build_model_chunks(_model_cfg(32), ctx, seed=1)
    s_local = 32 // C
    tokens = torch.randint(0, 32, (2, s_local), generator=torch.Generator().manual_seed(ctx.rank))
    with ctx.ledger.recording():
        losses = model(tokens, tokens)
        fwd = ctx.ledger.total("send", "cp").bytes
    with ctx.ledger.recording():
        losses.sum().backward()
        bwd = ctx.ledger.total("send", "cp").bytes
    return fwd / 2, bwd / 2


def _saved_attention_bytes(model, tokens) -> int:
    """Bytes of the activations the attention of layer 0 keeps for backward (unique storages,
    parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    attention = model.layers["0"].attention
    original = attention.forward

    def recorded(*args, **kw):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return original(*args, **kw)

    attention.forward = recorded
    model(tokens)
    return sum(seen.values())


def _memory(C: int, seq: int) -> int:
    ctx = ParallelContext.build(cp=C) if C > 1 else ParallelContext.single()
    (model,) = build_model_chunks(_model_cfg(seq), ctx, seed=1)
    tokens = torch.randint(0, 32, (1, seq // C))
    return _saved_attention_bytes(model, tokens)


def _world4():
    return {"bytes": {C: _ring_bytes(C) for C in (2, 4)}, "memory": _memory(4, 4096)}


def test_ring_ledger_and_memory_world4():
    """Ledger: per layer the ring sends 2(C-1) K/V blocks forward and 2(C-1) K/V + 2C dK/dV blocks
    backward (ratio 1.00 to that count), C=2 (on 2 of the 4 ranks' groups) and C=4.
    Memory: at s=4096 the attention's saved activations per rank at C=4 are <= 0.3x those at C=1."""
    results = run_ranks(_world4, 4, timeout=300)
    at_c1 = _memory(1, 4096)
    for res in results:
        for C, (fwd, bwd) in res["bytes"].items():
            block = (32 // C) * 2 * 2 * 4 * 4  # [s/C, b, local kv heads, d] fp32
            assert fwd / (2 * (C - 1) * block) == pytest.approx(1.0), (C, fwd)
            assert bwd / ((2 * (C - 1) + 2 * C) * block) == pytest.approx(1.0), (C, bwd)
        assert res["memory"] <= 0.3 * at_c1, (res["memory"], at_c1)


@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_kernels_match_the_math(causal):
    """The CPU flash kernels (forward with log-sum-exp, backward from the final out/lse) give the
    plain fp32 formulas of :mod:`paratron.models.context_parallel.kernels`, GQA included, to 1e-5."""
    from paratron.models.context_parallel import kernels as K

    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 2, 4, 8, generator=g)
    k, v = torch.randn(12, 2, 2, 8, generator=g), torch.randn(12, 2, 2, 8, generator=g)
    out, lse = K.block_forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = K.block_forward_math(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)
    dout = torch.randn(12, 2, 4, 8, generator=g)
    # As a block of a longer row: a final out/lse that also saw other keys.
    final_lse = torch.logaddexp(lse, torch.randn(12, 2, 4, generator=g))
    final_out = out * torch.exp(lse - final_lse).unsqueeze(-1)
    got = K.block_backward(q, k, v, final_out, final_lse, dout, causal, 0.3)
    want = K.block_backward_math(q, k, v, final_lse, dout, (dout * final_out).sum(-1), causal, 0.3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- all2all: one autograd function, the attention output kept once (2 ranks) ------------------

def _head_copies_of_output(ctx) -> int:
    """How many tensors layer 0's attention saves for backward that hold this rank's head-sharded
    copy ``[s, b, n/C, d]`` of its output (compared as sorted values, so in any layout), under
    all2all CP; the output projection's sequence-sharded input is the output's other layout."""
    (model,) = build_model_chunks(_model_cfg(64), ctx, seed=1, context_algorithm="all2all")
    attention, saved, proj_in = model.layers["0"].attention, [], []
    attention.proj.register_forward_pre_hook(lambda mod, args: proj_in.append(args[0].detach()))
    original = attention.forward

    def recorded(*args, **kw):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.detach()) or t, lambda t: t):
            return original(*args, **kw)

    attention.forward = recorded
    model(torch.randint(0, 32, (1, 32), generator=torch.Generator().manual_seed(ctx.rank)))
    y = proj_in[0]
    heads = all_to_all_seq_to_heads(y.reshape(*y.shape[:2], 4, 4), ctx.cp).flatten().sort().values
    return sum(t.numel() == heads.numel() and torch.equal(t.flatten().sort().values, heads) for t in saved)


def _ulysses_rank():
    """On each of 2 CP ranks: UlyssesAttention's output and input grads (this rank's shard) against
    SDPA over the whole sequence, GQA 4/2; and the head-layout copies of the output kept."""
    ctx = ParallelContext.build(cp=2)
    g = torch.Generator().manual_seed(3)
    s, b, d = 16, 2, 8
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (4, 2, 2))
    dout = torch.randn(s, b, 4, d, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in full), is_causal=True,
                                         enable_gqa=True, scale=0.3).permute(2, 0, 1, 3)
    ref.backward(dout)
    part = slice(ctx.cp.rank * s // 2, (ctx.cp.rank + 1) * s // 2)
    mine = [t[part].clone().requires_grad_() for t in (q, k, v)]
    out = UlyssesAttention.apply(*mine, ctx.cp, 0.3)
    out.backward(dout[part])
    return {"out": (out.detach(), ref[part].detach()),
            "grads": [(m.grad, f.grad[part]) for m, f in zip(mine, full)], "head_copies": _head_copies_of_output(ctx)}


def test_ulysses_matches_sdpa_and_keeps_the_output_once_world2():
    """all2all CP=2: the output and the q/k/v grads of each rank's shard match SDPA over the whole
    sequence (GQA) to 1e-5; and layer 0's attention keeps no head-sharded copy of its output for
    backward (only the sequence-sharded one the output projection shares; the composed
    all-to-all/SDPA/all-to-all path kept both)."""
    for res in run_ranks(_ulysses_rank, 2, timeout=300):
        torch.testing.assert_close(*res["out"], rtol=1e-5, atol=1e-5)
        for got, want in res["grads"]:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert res["head_copies"] == 0, res["head_copies"]
