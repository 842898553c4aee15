"""ZeRO-2 and ZeRO-3 (grads, and params, sharded over DP) on paratron's tiny GPT run through the
pipeline runtime, against one process running plain ``torch.optim.AdamW`` with
``clip_grad_norm_`` (the harness of ``test_optim_parallel``). Tolerance 1e-5 (fp32).

Also: the memory each rank holds, measured from the tensors actually allocated, against the
analytic ZeRO formulas (:func:`paratron.optim.zero.model_state_bytes_per_rank`); the bytes on
the wire from the comm ledger against DDP's; the all-gather prefetch.
"""

from __future__ import annotations

import math

import pytest
import torch

from paratron.config import ModelConfig
from paratron.models.gpt import build_model_chunks
from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads
from paratron.optim.reducers import AllReduceBuckets, ReduceScatterBuckets, StagedShards
from paratron.optim.zero import model_state_bytes_per_rank, storage_bytes
from paratron.parallel.context import ParallelContext
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.runtime import run_pipeline
from paratron.local_ranks import run_ranks

from helpers import gpt2_config
from test_optim_dp import Toy, _wire_bytes
from test_optim_parallel import (GLOBAL_B, HID, IGNORE, SEED, SEQ, VOCAB, _batch, _check_layouts, _L, _opt,
                                 _rank_layouts, train)

# ---- parity -------------------------------------------------------------------------------------


WORLD2 = [_L(1, 1, 2, 0.05), _L(1, 1, 3, 0.05),         # DP=2, 2 microbatches per rank
          _L(1, 1, 3, 0.05, reshard=False)]              # units kept gathered through the step
WORLD4 = [
    _L(1, 1, 2, 0.05, m=1), _L(1, 1, 3, 0.05, m=1),     # DP=4
    _L(2, 1, 3, 0.05),                                  # TP=2 x DP=2
    _L(2, 1, 3, 0.05, sp=True),                         # + sequence parallel (deferred buckets)
    _L(1, 2, 3, 0.05),                                  # PP=2 x DP=2, 1F1B, tied embedding copies
    _L(1, 2, 3, 0.05, schedule="zb-h1"),                # deferred W actions
    _L(1, 2, 3, 0.05, reshard=False),                   # kept across the microbatches
    _L(1, 2, 2, 0.05, schedule="interleaved", v=2),     # ZeRO-2 with virtual stages
    _L(1, 2, 3, 0.05, schedule="zbv", v=2),             # both ends (tied embedding) on one rank
    _L(2, 2, 3, 0.05),                                  # DP=1: groups of one gather by copying
]


@pytest.mark.parametrize("world,layouts", [(2, WORLD2), (4, WORLD4)], ids=["dp2", "world4"])
def test_zero23_parity(world, layouts):
    """ZeRO-2 and ZeRO-3 at DP=2 and DP=4; ZeRO-3 at DP=2 with TP=2 (SP on and off) and with PP=2
    (1F1B, ZB-H1 and ZBV); with zero3_reshard_after_forward=false; at DP=1 (TP=2 x PP=2); ZeRO-2
    with interleaved PP: 3 AdamW steps with clipping active match one
    process to 1e-5; replicas bitwise equal; grad norms and clip coefficients match."""
    _check_layouts(run_ranks(_rank_layouts, world, layouts, timeout=400), layouts)


# ---- mixed precision ----------------------------------------------------------------------------

def _rank_bf16():
    ctx = ParallelContext.build()
    seen = {}

    def probe(chunks, ddp, opt):
        shards = [t for row in ddp.param_shards.shards for t in row]
        seen["shards"] = {t.dtype for t in shards}
        seen["main"] = {s.main.dtype for s in opt.segments}
        seen["main_is_shard"] = any(s.main.data_ptr() == s.param.data_ptr() for s in opt.segments)
        with ddp.full_params():
            seen["gathered"] = {p.dtype for c in chunks for p in c.parameters()}

    batches = [_batch(s) for s in range(3)]
    zero1, _ = train(ctx, zero=1, clip=0.05, m=1, precision="bf16", batches=batches)
    zero3, _ = train(ctx, zero=3, clip=0.05, m=1, precision="bf16", batches=batches, probe=probe)
    return zero1, zero3, seen


def test_zero3_bf16_gathers_bf16_and_keeps_fp32_main_shards():
    """bf16 at DP=2: ZeRO-3 keeps bf16 param shards, gathers bf16 params and updates fp32 main
    weights that are separate shards; after 3 AdamW steps with clipping its params equal ZeRO-1's
    (the same arithmetic but for the summation order of the grad norm over other buckets) in at
    least 99% of the elements and within one bf16 ulp elsewhere."""
    for zero1, zero3, seen in run_ranks(_rank_bf16, 2, timeout=240):
        assert seen["shards"] == {torch.bfloat16} and seen["gathered"] == {torch.bfloat16}
        assert seen["main"] == {torch.float32} and not seen["main_is_shard"]
        same = sum(int((zero3[n] == t).sum()) for n, t in zero1.items())
        total = sum(t.numel() for t in zero1.values())
        for n, t in zero1.items():  # one bf16 ulp where the fp32 norm's summation order differs
            torch.testing.assert_close(zero3[n], t, rtol=2 ** -7, atol=1e-4, msg=n)
        assert same >= 0.99 * total, (same, total)


# ---- memory -------------------------------------------------------------------------------------

def _cfg_untied(layers=4) -> ModelConfig:
    return gpt2_config(num_layers=layers, hidden_size=HID, num_attention_heads=4, vocab_size=VOCAB,
                       seq_length=SEQ, tie_embeddings=False, make_vocab_size_divisible_by=4)


def _step(chunks, ctx, opt, step=0, m=1):
    ids, labels = _batch(step)
    total = (labels != IGNORE).sum()
    rows = GLOBAL_B // ctx.dp.size
    ids, labels = ids[ctx.dp.rank * rows:(ctx.dp.rank + 1) * rows], labels[ctx.dp.rank * rows:(ctx.dp.rank + 1) * rows]
    mbs = rows // m
    micro = [(ids[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(m)]

    def forward_step(chunk_id, chunk, x, mb):
        tok, lab = mb
        y = chunk(tok if x is None else x, lab if chunk.post_process else None)
        return y.sum() / total if chunk.post_process else y

    opt.zero_grad()
    run_pipeline(build_schedule("1f1b", ctx.pp.size, m, 1)[ctx.pp.rank], chunks, ctx, micro, forward_step,
                 (SEQ, mbs, HID), torch.float32, grad_sync=opt.ddp)
    in_backward = opt.ddp.num_launched()  # reductions started before finalisation
    finalize_grads(chunks, ctx, opt.ddp)
    opt.step()
    return in_backward


def _rank_memory(zero):
    ctx = ParallelContext.build()
    chunks = build_model_chunks(_cfg_untied(), ctx, seed=SEED)
    psi = sum(p.numel() for c in chunks for p in c.parameters())
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, zero=zero)
    opt = build_optimizer(chunks, ctx, _opt(0.05), ddp)
    unit_bytes = []
    if ddp.param_shards is not None:
        unit_bytes = sorted(sum(ddp.buffers[i].buckets[k].numel * 4 for i, k in u.buckets)
                            for u in ddp.param_shards.chunk_units[0])
        ddp.param_shards.reset_peak()
        fwd_peak = []
        chunks[-1].register_forward_hook(lambda *a: fwd_peak.append(ddp.param_shards.peak_gathered_bytes))
    in_backward = _step(chunks, ctx, opt)
    held = ddp.model_state_tensors()
    measured = {"params": storage_bytes(held["params"]), "grads": storage_bytes(held["grads"]),
                "optimizer": opt.state_bytes()}
    measured["total"] = sum(measured.values())
    peak = (fwd_peak[0], ddp.param_shards.peak_gathered_bytes) if ddp.param_shards is not None else None
    return psi, ctx.dp.size, measured, peak, unit_bytes, (in_backward, sum(len(b.buckets) for b in ddp.buffers))


def test_zero3_memory_at_dp4():
    """ZeRO-3 at DP=4, fp32 AdamW: bytes of params + grads + optimizer state each rank holds at
    the optimizer step <= 1.10 x 16 psi / 4; during the forward, and during the whole step, at most
    the two largest units' full params are gathered at once (prefetch included), and in the forward
    more than one (the prefetch did overlap)."""
    for psi, dp, measured, peak, units, _ in run_ranks(_rank_memory, 4, 3, timeout=240):
        analytic = model_state_bytes_per_rank(psi, zero=3, dp=dp)
        assert analytic["total"] == 16 * psi / 4
        ratio = measured["total"] / analytic["total"]
        assert ratio <= 1.10, (measured, analytic)
        assert measured["params"] <= 1.10 * 4 * psi / 4
        forward, step = peak
        assert forward <= units[-1] + units[-2] and step <= units[-1] + units[-2], (peak, units)
        assert forward > units[-1], (peak, units)


def test_zero2_grads_at_dp2():
    """ZeRO-2 at DP=2: every bucket's reduce-scatter starts during backward; the grad bytes each
    rank holds at the optimizer step <= 1.10 x 4 psi / DP (no full-size grad buffer), while the
    params stay whole."""
    for psi, dp, measured, _, _, (in_backward, buckets) in run_ranks(_rank_memory, 2, 2, timeout=240):
        assert buckets > 4 and in_backward == buckets  # every bucket reduce-scattered during backward
        analytic = model_state_bytes_per_rank(psi, zero=2, dp=dp)
        assert measured["grads"] / analytic["grads"] <= 1.10, (measured, analytic)
        assert measured["params"] >= 4 * psi


# ---- prefetch -----------------------------------------------------------------------------------

def _rank_prefetch(prefetch, reshard):
    ctx = ParallelContext.build()
    chunks = build_model_chunks(_cfg_untied(), ctx, seed=SEED)
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, zero=3, zero3_prefetch=prefetch,
                                  zero3_reshard_after_forward=reshard)
    opt = build_optimizer(chunks, ctx, _opt(0.0), ddp)
    shards = ddp.param_shards
    units = shards.chunk_units[0]
    launched_before = []
    for u in units:  # at each unit's forward: is the next unit's all-gather already issued?
        u.start.register_forward_pre_hook(
            lambda mod, args, u=u: launched_before.append(
                all(shards._full[i][k] is not None for i, k in units[u.pos + 1].buckets)
                if u.pos + 1 < len(units) else None), prepend=False)
    shards.reset_peak()
    _step(chunks, ctx, opt)
    total = sum(b.numel * 4 for buf in ddp.buffers for b in buf.buckets)
    return launched_before, shards.peak_gathered_bytes, total


@pytest.mark.parametrize("prefetch", [True, False])
def test_zero3_prefetch_issues_next_all_gather_early(prefetch):
    """With prefetch, by the time a unit's forward runs the next unit's all-gather is in flight;
    without, it is not. With ``zero3_reshard_after_forward=false`` every unit stays gathered."""
    launched, peak, _ = run_ranks(_rank_prefetch, 2, prefetch, True, timeout=240)[0]
    assert launched[-1] is None and all(v is prefetch for v in launched[:-1]), launched
    _, peak_kept, total = run_ranks(_rank_prefetch, 2, prefetch, False, timeout=240)[0]
    assert peak < total and peak_kept == total


# ---- ledger -------------------------------------------------------------------------------------

def _rank_ledger(zero):
    ctx = ParallelContext.build()
    chunks = build_model_chunks(_cfg_untied(), ctx, seed=SEED)
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, zero=zero)
    opt = build_optimizer(chunks, ctx, _opt(0.05), ddp)
    _step(chunks, ctx, opt)  # a first step outside the recording
    with ctx.ledger.recording():
        _step(chunks, ctx, opt, step=1)
        padded = sum(b.numel for buf in ddp.buffers for b in buf.buckets) * 4
        kept = 0  # the units whose backward runs first and second stay gathered from their forward on
        if ddp.param_shards is not None:
            kept = sum(ddp.buffers[i].buckets[k].numel * 4 for units in ddp.param_shards.chunk_units
                       for u in units if u.keep_after_forward for i, k in u.buckets)
        return ctx.ledger.summary(), ctx.dp_cp.size, padded, kept


def test_ledger_zero2_and_zero3_against_ddp():
    """One microbatch per step at DP=2: ZeRO-2 moves what DDP's all-reduce moves (reduce-scatter
    in backward, all-gather after the update) and ZeRO-3 1.5x less the two units kept gathered from
    their forward to their backward (all-gather in forward, again in backward for every other unit,
    reduce-scatter): ratio 1.00 against those counts of each run's own padded buckets, and
    against DDP's measured bytes to the padding (< 1e-3)."""
    runs = {z: run_ranks(_rank_ledger, 2, z, timeout=240)[0] for z in (0, 2, 3)}
    n = runs[0][1]
    ddp_bytes = _wire_bytes(runs[0][0], n)
    for zero in (2, 3):
        summary, _, padded, kept = runs[zero]
        assert "all_reduce@dp_cp" not in summary
        assert (kept > 0) == (zero == 3)
        factor = 1.0 if zero == 2 else 1.5 - kept / (2 * padded)
        moved = _wire_bytes(summary, n)
        assert moved / (factor * 2 * (n - 1) / n * padded) == pytest.approx(1.0, abs=1e-12), summary
        assert moved / ddp_bytes == pytest.approx(factor, rel=1e-3)
    assert runs[0][0]["all_reduce@dp_cp"]["bytes"] == runs[0][2]


def test_analytic_bytes_formula():
    """fp32 AdamW: 4 (params) + 4 (grads) + 8 (moments) bytes per param, divided by N stage by
    stage as in Rajbhandari et al. 2020 figure 1; bf16 params add an fp32 main copy."""
    psi, n = 1000, 8
    fp32 = [model_state_bytes_per_rank(psi, zero=z, dp=n)["total"] for z in range(4)]
    assert fp32 == [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    bf16 = model_state_bytes_per_rank(psi, zero=3, dp=n, param_bytes=2)
    assert bf16["total"] == (2 + 4 + 12) * psi / n
    with pytest.raises(ValueError, match="parallel.zero=4"):
        model_state_bytes_per_rank(psi, zero=4, dp=n)
    assert math.isclose(model_state_bytes_per_rank(psi, zero=0, dp=1, optimizer="sgd")["total"], 12 * psi)


# ---- one reducer per stage -----------------------------------------------------------------------
def test_ddp_picks_one_reducer_per_stage():
    ctx = ParallelContext.single()
    kinds = [AllReduceBuckets, ReduceScatterBuckets, StagedShards, StagedShards]
    for zero, kind in enumerate(kinds):
        ddp = DistributedDataParallel([Toy()], ctx, zero=zero)
        assert type(ddp.reducer) is kind and ddp.reducer.stage == zero
        assert (ddp.param_shards is not None) == (zero == 3)
        assert all((b.grad_data is not None) == (zero < 2) for b in ddp.buffers)
    with pytest.raises(ValueError, match="parallel.zero=4"):
        DistributedDataParallel([Toy()], ctx, zero=4)
