"""Recompute placed in bubbles (Obscura): the ``R`` action, :func:`place_recompute`, the
validator's recompute and memory rules, the simulator's cost of ``R``, and runtime parity: the
placed schedule gives the same losses and grads as plain full recompute (and as no recompute),
to 1e-6 in fp32, at PP=2 and PP=4 under 1F1B and interleaved.
"""

from __future__ import annotations

import pytest
import torch

from paratron.models.gpt import build_model_chunks
from paratron.optim import finalize_grads
from paratron.parallel.context import ParallelContext
from paratron.pipeline.actions import Action, activation_peak
from paratron.pipeline.partition import stage_layers
from paratron.pipeline.recompute_placement import place_recompute, with_full_recompute
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.runtime import run_pipeline
from paratron.pipeline.simulator import Costs, simulate
from paratron.pipeline.validate import ScheduleError, validate
from paratron.local_ranks import run_ranks

from helpers import perturb_1d_params_
from test_pipeline_runtime import GLOBAL_BATCH, HIDDEN, LAYERS, SEED, SEQ, _cfg, _forward_step, _global_batch

TOL = 1e-6
UNIT = Costs(F=1, B=1, W=0, BW=1, R=1)  # the F = B = 1, R = 1


def _variants(schedule, p, m, v):
    """The three lists of one schedule: no recompute, plain full recompute, placed recompute."""
    base = build_schedule(schedule, p, m, v)
    full = with_full_recompute(base)
    return {"none": base, "full": full, "placed": place_recompute(full, memory_budget=1)}


def _run(p, combos, dropout):
    ctx = ParallelContext.build(pp=p) if p > 1 else ParallelContext.single()
    out = []
    for schedule, m, v in combos:
        ids, labels = _global_batch()
        total = (labels != -100).sum()
        mbs = GLOBAL_BATCH // m
        micro = [(ids[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(m)]
        for name, lists in _variants(schedule, p, m, v).items():
            cfg = _cfg()
            cfg.hidden_dropout = cfg.attention_dropout = dropout
            chunks = build_model_chunks(cfg, ctx, seed=SEED, stage_layers=stage_layers(LAYERS, p, v, None, schedule))
            perturb_1d_params_(chunks)
            torch.manual_seed(7)  # the same dropout stream for every variant
            losses = run_pipeline(lists[ctx.pp.rank], chunks, ctx, micro, _forward_step(total),
                                  (SEQ, mbs, HIDDEN), torch.float32)
            finalize_grads(chunks, ctx)
            grads = {q.meta.logical_name: q.grad.clone() for c in chunks for q in c.parameters()}
            out.append(((schedule, m, v, name), [x.item() for x in losses], grads))
    return out


def _assert_same(results, combos):
    """Per combo: 'placed' and 'none' agree with 'full' on every rank, losses and grads, to TOL."""
    for rank_results in results:
        by_key = {key: (losses, grads) for key, losses, grads in rank_results}
        for schedule, m, v in combos:
            full_losses, full_grads = by_key[(schedule, m, v, "full")]
            for other in ("placed", "none"):
                losses, grads = by_key[(schedule, m, v, other)]
                assert losses == pytest.approx(full_losses, abs=TOL), (schedule, other)
                for name, g in full_grads.items():
                    err = (grads[name] - g).abs().max().item()
                    assert err < TOL, f"{schedule} m={m} v={v} {other}: {name} grad differs by {err:.3g}"


@pytest.mark.parametrize("p", [2, 4])
def test_placed_recompute_matches_full_recompute(p):
    combos = [("1f1b", 4, 1), ("interleaved", 4, 2)]
    _assert_same(run_ranks(_run, p, p, combos, 0.0, timeout=300), combos)


def test_recompute_replays_dropout_on_one_rank():
    """With dropout, R must draw the masks its F drew: otherwise the grads differ from no recompute."""
    combos = [("interleaved", 4, 2)]
    _assert_same([_run(1, combos, 0.2)], combos)


# ---- validator, simulator, placement ------------------------------------------------------------
def test_validator_rejects_r_after_b_and_a_budget_overrun():
    full = with_full_recompute(build_schedule("1f1b", 2, 4, 1))
    validate(full, 4, memory_budget=1)
    late = [list(acts) for acts in full]
    i = late[1].index(Action("R", 0, 1))
    late[1].insert(i + 2, late[1].pop(i))  # R0 after BW0 on the last stage
    assert late[1][i] == Action("BW", 0, 1)
    with pytest.raises(ScheduleError, match="before its recompute"):
        validate(late, 4)
    greedy = [list(acts) for acts in full]
    greedy[0].insert(greedy[0].index(Action("F", 1, 0)) + 1, greedy[0].pop(greedy[0].index(Action("R", 1, 0))))
    greedy[0].insert(greedy[0].index(Action("F", 0, 0)) + 1, greedy[0].pop(greedy[0].index(Action("R", 0, 0))))
    validate(greedy, 4, memory_budget=2)
    with pytest.raises(ScheduleError, match="exceed memory_budget=1"):
        validate(greedy, 4, memory_budget=1)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2)])
def test_placed_recompute_beats_full_recompute_in_the_simulator(schedule, v):
    p, m = 4, 8
    lists = _variants(schedule, p, m, v)
    full, placed = simulate(lists["full"], UNIT), simulate(lists["placed"], UNIT)
    assert placed.makespan < full.makespan
    assert max(placed.peak_in_flight) <= 1
    assert sorted(map(str, sum(placed_lists := lists["placed"], []))) == sorted(map(str, sum(lists["full"], [])))
    validate(placed_lists, m, memory_budget=1)


def test_r_costs_and_counts_in_flight():
    assert Costs(F=2.0)(Action("R", 0, 0)) == 2.0 and Costs(F=2.0, R=3.0)(Action("R", 0, 0)) == 3.0
    one = with_full_recompute(build_schedule("gpipe", 1, 3, 1))
    assert activation_peak(one[0]) == 1 and activation_peak(build_schedule("gpipe", 1, 3, 1)[0]) == 3
    assert simulate(one, Costs(F=1, B=1, W=0, R=5)).makespan == 3 * (1 + 5 + 1)


def test_place_recompute_input_errors():
    base = build_schedule("1f1b", 2, 4, 1)
    with pytest.raises(ValueError, match="has no R"):
        place_recompute(base, 1)
    with pytest.raises(ValueError, match="memory_budget=0"):
        place_recompute(with_full_recompute(base), 0)
