"""The planner's search is exact: its step-time bound is below every simulated schedule, and the
bound-pruned, memoised search returns the top k of simulating every accepted layout."""

from __future__ import annotations

import random

import pytest

from paratron.config import Config, ConfigError, ModelConfig
from paratron.pipeline.registry import SCHEDULES, get_schedule
from paratron.pipeline.placement import rank_of_stage
from paratron.planner import layouts as layouts_mod
from paratron.planner.bound import pipeline_floor
from paratron.planner.compute import Work
from paratron.planner.estimate import (Problem, finish, fixed_seconds, memory_per_rank, p2p_seconds,
                                       stage_works)
from paratron.planner.hardware import Cluster, device
from paratron.planner.pipeline import ScheduleCache, makespan
from paratron.planner.compute import STAGE_WORK_FREE
from paratron.planner.search import distinct, plan, rank_key
from paratron.planner.shape import Shape

CAL = {"gemm_flops": 2e10, "nproc": 4, "cores": 2, "mem_bandwidth": 5e9, "op_overhead": 2e-5,
       "gloo_bandwidth": 1e9, "gloo_latency": 2e-4}


@pytest.mark.parametrize("name", SCHEDULES.names())
def test_pipeline_floor_is_below_every_simulated_makespan(name):
    # Uneven stages, latency and core sharing drawn at random: the floor must never pass the
    # simulated makespan of the schedule's own lists (the search's exactness rests on it).
    rng, cache, checked = random.Random(0), ScheduleCache(), 0
    spec = get_schedule(name)
    for p, m in ((2, 4), (4, 8), (4, 5), (3, 6)):
        for v in ((spec.virtual_stages,) if spec.virtual_stages else (1, 2)):
            try:
                lists = cache.lists(name, p, m, v)
            except ValueError:
                continue  # this schedule refuses (p, m, v)
            ranks = [rank_of_stage(spec.placement(p, v))[s] for s in range(p * v)]
            for _ in range(6):
                works = [Work(rng.uniform(0.2, 2), rng.uniform(0.2, 3), rng.uniform(0.0, 2)) for _ in ranks]
                lat, sharing = rng.choice((0.0, 0.05, 1.0)), rng.choice((1.0, 2.0))
                floor = pipeline_floor(works, ranks, m, lat, sharing)
                assert floor <= makespan(lists, works, lat, sharing).makespan * (1 + 1e-12)
                checked += 1
    assert checked >= 6


def test_pipeline_floor_is_tight_without_a_pipeline():
    works = [Work(1.0, 2.0, 0.5)]
    assert pipeline_floor(works, [0], 8, 0.3) == pytest.approx(8 * 3.5)


def _exhaustive(prob: Problem, layouts, top_k: int):
    """The reference: simulate every accepted layout (no bound, no memoised makespan)."""
    cache, out = ScheduleCache(), []
    for lay in distinct(layouts):
        m = lay.microbatches(prob.global_batch_size)
        works = stage_works(prob.shape, lay, prob.cluster, prob.fused_attention)
        try:
            pipe = makespan(cache.lists(lay.schedule, lay.pp, m, lay.vpp), works, p2p_seconds(prob, lay),
                            prob.cluster.hw.sharing)
        except ValueError:
            continue
        mem = memory_per_rank(prob, lay, cache.flight(lay.schedule, lay.pp, m, lay.vpp))
        if mem[0].total <= prob.cluster.hw.memory_bytes:
            out.append(finish(prob, lay, works, fixed_seconds(prob, lay, works), pipe, mem))
    return sorted(out, key=rank_key)[:top_k]


def _case(gpu: str, world: int, gbs: int, memory_gb: float, **model):
    cfg = Config(model=ModelConfig(**model))
    hw = device(gpu, calibration=CAL if gpu == "cpu" else None, memory_gb=memory_gb)
    return Problem(cfg.model, Shape.of(cfg.model, cfg.model.seq_length), Cluster(1, world, hw), gbs,
                   cfg.model.seq_length, fused_attention=gpu == "cpu"), cfg


def _narrow(cfg, world):
    p = cfg.parallel
    if p.tensor > 1 or p.context > 1 or p.zero > 0:
        raise ConfigError("parallel.tensor, parallel.context and parallel.zero are 1, 1, 0 in this test")


@pytest.mark.parametrize("gpu,world,gbs,memory_gb,model", [
    # CPU: ranks share cores (sharing 2), so the bound's shared-speed term is exercised.
    ("cpu", 4, 8, 1.0, dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=512,
                            make_vocab_size_divisible_by=16)),
    # A100s, no TP/CP/ZeRO (a narrowing rule, to keep the test fast) and too little memory for one
    # pipeline stage: the top plans are pipelines of several schedules, chunk counts and microbatches.
    ("a100", 8, 32, 10.0, dict(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=1024,
                               vocab_size=32000)),
])
def test_pruned_search_returns_the_exhaustive_top_k(monkeypatch, gpu, world, gbs, memory_gb, model):
    prob, cfg = _case(gpu, world, gbs, memory_gb, **model)
    if gpu != "cpu":
        monkeypatch.setattr(layouts_mod, "VALIDATORS", [*layouts_mod.VALIDATORS, _narrow])
    result = plan(prob, cfg, top_k=6)
    want = _exhaustive(prob, result.all_layouts, 6)
    assert [e.layout for e in result.plans] == [e.layout for e in want]
    assert [e.step_time for e in result.plans] == pytest.approx([e.step_time for e in want], rel=1e-12)
    assert result.simulated < len(distinct(result.all_layouts)) / 4  # the bound did prune
    if gpu != "cpu":
        assert len({(e.layout.schedule, e.layout.vpp) for e in want if e.layout.pp > 1}) >= 3


class _NoSchedule:
    """A layout whose fields in :data:`paratron.planner.compute.STAGE_WORK_FREE` raise when read."""

    def __init__(self, lay):
        self._lay = lay

    def __getattr__(self, name):
        if name in STAGE_WORK_FREE:
            raise AssertionError(f"stage_works read layout.{name}")
        return getattr(self._lay, name)


@pytest.mark.parametrize("model", [
    dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=64, vocab_size=1024,
         num_experts=4, moe_top_k=2, ffn_hidden_size=128, moe_layer_freq=2),
    dict(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=51200),
])
def test_stage_works_read_no_zero_and_no_schedule(model):
    """The search costs stage seconds once per layout less ZeRO and schedule: they must not read them."""
    cfg = Config(model=ModelConfig(**model))
    shape, cluster = Shape.of(cfg.model, cfg.model.seq_length), Cluster(2, 8, device("a100", memory_gb=80))
    layouts = layouts_mod.enumerate_layouts(cfg, 16, 32, cfg.model.seq_length, "bf16")[0]
    assert {lay.zero for lay in layouts} >= {0, 3} and len({lay.schedule for lay in layouts}) >= 3
    for lay in layouts[::53]:
        assert stage_works(shape, _NoSchedule(lay), cluster) == stage_works(shape, lay, cluster)
