"""Pipeline runtime parity: a tiny tied GPT-2-style model at PP=2 and PP=4 under every schedule
matches one process (loss per microbatch and every parameter's grad within 1e-5, fp32), with
gradient accumulation over 1, 2, 4 and 8 microbatches at a fixed global batch of 8 samples.
Also: zero-layer stages train 2 steps like PP=1; a schedule defined here registers, validates,
simulates and runs; evaluation (forward only); p2p through the ledger; a recorded timeline.
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.models.gpt import build_model_chunks
from paratron.optim import finalize_grads
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import unique_params
from paratron.pipeline.actions import BW, F
from paratron.pipeline.partition import stage_layers
from paratron.pipeline.registry import SCHEDULES, build_schedule
from paratron.pipeline.runtime import run_pipeline
from paratron.pipeline.schedules import check_1f1b, with_p2p
from paratron.pipeline.simulator import simulate
from paratron.pipeline.timeline import write_chrome_trace
from paratron.pipeline.validate import validate
from paratron.local_ranks import run_ranks

from helpers import gpt2_config, perturb_1d_params_

TOL = 1e-5
SEQ, GLOBAL_BATCH, VOCAB, HIDDEN, LAYERS = 8, 8, 37, 16, 8
SEED = 3


def _cfg(num_layers=LAYERS) -> ModelConfig:
    return gpt2_config(num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=VOCAB,
                       seq_length=SEQ)


def _global_batch(step=0):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    labels[0, :3] = -100
    return ids, labels


def _forward_step(total_tokens):
    def step(chunk_id, chunk, x, microbatch):
        ids, labels = microbatch
        out = chunk(ids if x is None else x, labels if chunk.post_process else None)
        return out.sum() / total_tokens if chunk.post_process else out
    return step


def _reference(num_layers=LAYERS, steps=1, lr=0.0):
    """One process, whole global batch: per-microbatch-agnostic per-token losses, grads by name."""
    ctx = ParallelContext.single()
    (model,) = build_model_chunks(_cfg(num_layers), ctx, seed=SEED)
    perturb_1d_params_([model])
    history = []
    for step in range(steps):
        ids, labels = _global_batch(step)
        model.zero_grad(set_to_none=True)
        token_losses = model(ids, labels)  # [s, b]
        total = (labels != -100).sum()
        (token_losses.sum() / total).backward()
        history.append((token_losses.detach() / total, {p.meta.logical_name: p.grad.clone() for p in model.parameters()}))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(lr * p.grad)
    return history, {p.meta.logical_name: p.detach().clone() for p in model.parameters()}


def _pipeline_step(ctx, chunks, schedule, m, v, step=0, forward_only=False, timeline=None):
    ids, labels = _global_batch(step)
    total = (labels != -100).sum()
    mbs = GLOBAL_BATCH // m
    micro = [(ids[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(m)]
    actions = build_schedule(schedule, ctx.pp.size, m, v)[ctx.pp.rank]
    return run_pipeline(actions, chunks, ctx, micro, _forward_step(total), (SEQ, mbs, HIDDEN), torch.float32,
                        forward_only=forward_only, timeline=timeline)


def _build(ctx, schedule, v, layout=None, num_layers=LAYERS):
    layers = stage_layers(num_layers, ctx.pp.size, v, layout, schedule)
    chunks = build_model_chunks(_cfg(num_layers), ctx, seed=SEED, stage_layers=layers)
    perturb_1d_params_(chunks)
    return chunks


def _grads_by_name(chunks):
    out = {}
    for p in unique_params(chunks):
        assert p.grad is not None, f"{p.meta.logical_name} has no grad at the optimizer step"
        out[p.meta.logical_name] = p.grad.clone()
    return out


def _sweep(p, combos):
    """On every rank: for each (schedule, m, v), build the model, run one step, return losses and grads."""
    ctx = ParallelContext.build(pp=p)
    results = []
    for schedule, m, v in combos:
        chunks = _build(ctx, schedule, v)
        with ctx.ledger.recording():
            losses = _pipeline_step(ctx, chunks, schedule, m, v)
            sends = ctx.ledger.total("send", "pp").calls
        finalize_grads(chunks, ctx)
        planned = sum(a.kind.startswith("SEND") for a in build_schedule(schedule, p, m, v)[ctx.pp.rank])
        assert sends == planned, (schedule, m, sends, planned)
        results.append((losses, _grads_by_name(chunks)))
    return results


def _combos(p):
    out = []
    for schedule in ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]:
        v = 2 if schedule in ("interleaved", "zbv") else 1
        for m in ([1, 2, 4, 8] if schedule == "1f1b" else [1, 4, 8]):
            if schedule == "interleaved" and m % p:
                continue
            out.append((schedule, m, v))
    return out


def _check(results_by_rank, combos, ref_losses, ref_grads, p):
    for i, (schedule, m, v) in enumerate(combos):
        where = f"{schedule} p={p} m={m} v={v}"
        merged = {}
        losses = None
        for rank_results in results_by_rank:
            rank_losses, grads = rank_results[i]
            if rank_losses:
                assert losses is None, f"{where}: two ranks returned losses"
                losses = rank_losses
            for name, g in grads.items():
                if name in merged:  # the tied embedding's two copies must agree after the all-reduce
                    assert torch.allclose(merged[name], g, atol=1e-7, rtol=0), f"{where}: tied copies differ"
                merged[name] = g
        mbs = GLOBAL_BATCH // m
        expected = [ref_losses[:, k * mbs:(k + 1) * mbs].sum() for k in range(m)]
        assert losses is not None and len(losses) == m, where
        for k in range(m):
            assert abs(losses[k].item() - expected[k].item()) < TOL, f"{where}: microbatch {k} loss"
        assert merged.keys() == ref_grads.keys(), where
        for name, g in ref_grads.items():
            err = (merged[name] - g).abs().max().item()
            assert err < TOL, f"{where}: {name} grad differs by {err:.3g}"


@pytest.mark.parametrize("p", [2, 4])
def test_every_schedule_matches_single_process(p):
    ref_losses, ref_grads = _reference()[0][0]
    combos = _combos(p)
    results = run_ranks(_sweep, p, p, combos, timeout=300)
    _check(results, combos, ref_losses, ref_grads, p)


# ---- zero-layer stages, two training steps ----------------------------------------------------
def _train_two_steps(p, schedule, v, layout):
    ctx = ParallelContext.build(pp=p)
    chunks = _build(ctx, schedule, v, layout)
    params = unique_params(chunks)
    layer_counts = [len(c.layer_ids) for c in chunks]
    losses = []
    for step in range(2):
        for q in params:
            q.grad = None
        losses.append(_pipeline_step(ctx, chunks, schedule, 4, v, step=step))
        finalize_grads(chunks, ctx)
        with torch.no_grad():
            for q in params:
                q.sub_(0.5 * q.grad)
    return layer_counts, losses, {q.meta.logical_name: q.detach().clone() for q in params}


@pytest.mark.parametrize("p,schedule,v,layout", [
    (4, "1f1b", 1, [0, 4, 4, 0]),
    (2, "zbv", 2, [0, 4, 4, 0]),
])
def test_zero_layer_stages_train_like_single_process(p, schedule, v, layout):
    history, ref_params = _reference(steps=2, lr=0.5)
    results = run_ranks(_train_two_steps, p, p, schedule, v, layout, timeout=300)
    counts = sorted(c for r in results for c in r[0])
    assert counts == sorted(layout) and 0 in counts
    for step in range(2):
        (losses,) = [r[1][step] for r in results if r[1][step]]
        assert abs(sum(x.item() for x in losses) - history[step][0].sum().item()) < TOL
    for _, _, params in results:
        for name, t in params.items():
            err = (t - ref_params[name]).abs().max().item()
            assert err < TOL, f"{name} after 2 steps differs by {err:.3g}"


# ---- a user-defined schedule --------------------------------------------------------------------
def short_warmup_1f1b(p, m, v):
    """1F1B with one warm-up forward fewer on every rank but the last two: less activation memory,
    a longer bubble."""
    check_1f1b(p, m, v)
    ranks = []
    for r in range(p):
        warmup = min(max(p - r - 2, 0), m)
        acts = [F(i, r) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [F(warmup + i, r), BW(i, r)]
        acts += [BW(i, r) for i in range(m - warmup, m)]
        ranks.append(acts)
    return with_p2p(ranks)


@pytest.fixture
def custom_schedule():
    SCHEDULES.register("short-warmup", short_warmup_1f1b, check=check_1f1b, replace=True)
    yield "short-warmup"
    SCHEDULES.unregister("short-warmup")


def _custom_rank(p, m):
    SCHEDULES.register("short-warmup", short_warmup_1f1b, check=check_1f1b, replace=True)
    return _sweep(p, [("short-warmup", m, 1)])


def test_custom_schedule_registers_validates_simulates_runs(custom_schedule):
    p, m = 4, 8
    lists = build_schedule(custom_schedule, p, m, 1)
    validate(lists, m)
    sim, base = simulate(lists), simulate(build_schedule("1f1b", p, m, 1))
    assert sim.peak_in_flight[0] == p - 1 < base.peak_in_flight[0]
    assert sim.makespan > base.makespan
    with pytest.raises(ValueError, match="one model chunk per rank"):
        build_schedule(custom_schedule, p, m, 2)
    ref_losses, ref_grads = _reference()[0][0]
    results = run_ranks(_custom_rank, p, p, m, timeout=300)
    _check(results, [(custom_schedule, m, 1)], ref_losses, ref_grads, p)


# ---- evaluation and a recorded timeline ---------------------------------------------------------
def _eval_and_trace(p, trace_path):
    ctx = ParallelContext.build(pp=p)
    chunks = _build(ctx, "interleaved", 2)
    events = []
    train = _pipeline_step(ctx, chunks, "interleaved", 4, 2, timeline=events)
    evaluated = _pipeline_step(ctx, chunks, "interleaved", 4, 2, forward_only=True)
    planned = build_schedule("interleaved", p, 4, 2)[ctx.pp.rank]
    assert [(e.kind, e.microbatch, e.stage) for e in events] == [(a.kind, a.microbatch, a.stage) for a in planned]
    assert all(e.end >= e.start >= 0 for e in events)
    if ctx.pp.rank == 0:
        write_chrome_trace(events, trace_path)
    no_grad = all(q.grad is None for q in unique_params(_build(ctx, "interleaved", 2)))
    return train, evaluated, no_grad


def test_forward_only_and_recorded_timeline(tmp_path):
    results = run_ranks(_eval_and_trace, 2, 2, str(tmp_path / "run.json"), timeout=300)
    (train, evaluated, _), = [r for r in results if r[0]]
    assert len(evaluated) == 4
    for a, b in zip(train, evaluated):
        assert abs(a.item() - b.item()) < 1e-6
    assert (tmp_path / "run.json").exists()


# ---- one rank, several chunks (no processes) ----------------------------------------------------
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                        ("zb-h1", 1), ("zbv", 2)])
def test_single_rank_schedules_match(schedule, v):
    """p=1: stages on one rank hand activations and grads over locally; B/W split in one process."""
    ref_losses, ref_grads = _reference()[0][0]
    ctx = ParallelContext.single()
    chunks = _build(ctx, schedule, v)
    assert len(chunks) == v
    losses = _pipeline_step(ctx, chunks, schedule, 4, v)
    finalize_grads(chunks, ctx)
    _check([[(losses, _grads_by_name(chunks))]], [(schedule, 4, v)], ref_losses, ref_grads, 1)


def test_b_defers_weight_grads_and_missing_w_is_an_error():
    ctx = ParallelContext.single()
    chunks = _build(ctx, "zb-h1", 1)
    ids, labels = _global_batch()
    step = _forward_step((labels != -100).sum())
    shape = (SEQ, GLOBAL_BATCH, HIDDEN)
    from paratron.pipeline.actions import Action
    with pytest.raises(RuntimeError, match="deferred weight-grad groups are still queued"):
        run_pipeline([F(0, 0), Action("B", 0, 0)], chunks, ctx, [(ids, labels)], step, shape, torch.float32)
    # The B computed the norms' grads at once but left every linear weight without a grad.
    linear = [p for p in unique_params(chunks) if p.meta.logical_name.endswith("fc1.weight")]
    norms = [p for p in unique_params(chunks) if "norm" in p.meta.logical_name]
    assert linear and all(p.grad is None for p in linear)
    assert norms and all(p.grad is not None for p in norms)


def test_runtime_input_errors():
    ctx = ParallelContext.single()
    chunks = _build(ctx, "1f1b", 1)
    ids, labels = _global_batch()
    step = _forward_step((labels != -100).sum())
    with pytest.raises(ValueError, match="2 model chunks were given"):
        run_pipeline([F(0, 0), BW(0, 0)], chunks * 2, ctx, [(ids, labels)], step, (SEQ, 8, HIDDEN), torch.float32)
    with pytest.raises(ValueError, match="uses microbatch 1 but only 1"):
        run_pipeline([F(1, 0), BW(1, 0)], chunks, ctx, [(ids, labels)], step, (SEQ, 8, HIDDEN), torch.float32)
    with pytest.raises(ValueError, match="scalar loss"):
        run_pipeline([F(0, 0), BW(0, 0)], chunks, ctx, [(ids, labels)], lambda c, m, x, mb: m(mb[0], mb[1]),
                     (SEQ, 8, HIDDEN), torch.float32)
