"""The remembered rule verdicts (planner/verdicts.py) change nothing: the accepted layouts, the
refusal counts and the ranked plans are those of running every rule on every candidate."""

from __future__ import annotations

import functools

import pytest

from paratron.config import Config, ConfigError, ModelConfig
from paratron.planner import layouts as layouts_mod
from paratron.planner import search as search_mod
from paratron.planner import verdicts
from paratron.planner.estimate import Problem
from paratron.planner.hardware import Cluster, device
from paratron.planner.layouts import enumerate_layouts
from paratron.planner.search import plan
from paratron.planner.shape import Shape

TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=512,
            make_vocab_size_divisible_by=16)
MOE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2, seq_length=64,
           vocab_size=1024, num_experts=4, moe_top_k=2, ffn_hidden_size=128)
GPT = dict(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=51200,
           normalization="layernorm", position_embedding_type="learned", activation="gelu")
CASES = [  # (model, world, global batch, precision)
    (TINY, 8, 8, "fp32"),
    (MOE, 8, 16, "bf16"),
    (GPT, 24, 24, "bf16"),
]


def _both(cfg: Config, world: int, gbs: int, seq: int, precision: str):
    fast = enumerate_layouts(cfg, world, gbs, seq, precision)
    every = enumerate_layouts(cfg, world, gbs, seq, precision, remember=False)
    return fast, every


@pytest.mark.parametrize("model,world,gbs,precision", CASES)
def test_remembered_verdicts_change_no_layout_and_no_count(model, world, gbs, precision):
    cfg = Config(model=ModelConfig(**model))
    (fast, fast_refused), (every, every_refused) = _both(cfg, world, gbs, cfg.model.seq_length, precision)
    assert len(fast) > 100 and fast == every
    assert fast_refused == every_refused


def _sp_zero2_refused(cfg, world):
    """A planted rule reading its field only through ``vars()`` (as ``_finite`` reads floats)."""
    if vars(cfg.parallel)["zero"] == 2 and cfg.parallel.sequence_parallel:
        raise ConfigError("parallel.zero=2 with parallel.sequence_parallel (a rule planted by the test)")


def test_a_rule_reading_a_whole_section_is_keyed_on_all_of_it(monkeypatch):
    cfg = Config(model=ModelConfig(**TINY))
    monkeypatch.setattr(layouts_mod, "VALIDATORS", [*layouts_mod.VALIDATORS, _sp_zero2_refused])
    fast, every = _both(cfg, 8, 8, 16, "fp32")
    assert fast == every and any("planted" in rule for rule in fast[1])
    # Not counting vars() as a read of every field keys the planted rule on nothing: it answers
    # every candidate with the verdict of the first, and the comparison above sees it.
    monkeypatch.setattr(verdicts, "SAFE_DUNDERS", verdicts.SAFE_DUNDERS | {"__dict__"})
    assert enumerate_layouts(cfg, 8, 8, 16, "fp32") != every


def test_a_field_left_out_of_the_key_is_seen(monkeypatch):
    """A memo keyed too coarsely (the microbatch size not among the fields a layout writes) gives
    the batch rule's first verdict to every microbatch size: the comparison fails."""
    cfg = Config(model=ModelConfig(**TINY))
    every = enumerate_layouts(cfg, 8, 8, 16, "fp32", remember=False)

    def coarse(*args):
        written = verdicts.fields_written(*args)
        return {s: tuple(f for f in fs if f != "micro_batch_size") for s, fs in written.items()}

    monkeypatch.setattr(layouts_mod, "fields_written", coarse)
    assert enumerate_layouts(cfg, 8, 8, 16, "fp32") != every


def _counting_rule(cfg, world):
    """A planted rule that writes the config (a counter) and refuses on its value: no verdict
    of it, or of the rules after it, may be remembered."""
    cfg.train.seed += 1
    if cfg.train.seed % 7 == 0:
        raise ConfigError(f"train.seed={cfg.train.seed} (a rule planted by the test)")


def test_a_rule_writing_the_config_turns_the_memo_off(monkeypatch):
    monkeypatch.setattr(layouts_mod, "VALIDATORS", [*layouts_mod.VALIDATORS[:3], _counting_rule,
                                                    *layouts_mod.VALIDATORS[3:]])
    cfg = Config(model=ModelConfig(**TINY))
    fast, every = _both(cfg, 8, 8, 16, "fp32")
    assert fast == every and any("planted" in rule for rule in fast[1])


def test_fields_written_are_those_the_layout_sets():
    written = verdicts.fields_written(Config(), lambda c: layouts_mod.apply(
        c, layouts_mod.Layout(2, 1, 1, 4, 1, 1, 0, "1f1b", 1, "none", True), 8, 16, "fp32"))
    assert set(written) == {"parallel", "train", "model"}
    assert {"tensor", "pipeline", "zero", "schedule", "sequence_parallel"} <= set(written["parallel"])
    assert set(written["train"]) == {"micro_batch_size", "global_batch_size", "precision"}


@pytest.mark.slow
def test_ranked_plans_are_those_of_every_rule_on_every_candidate(monkeypatch):
    """The planner's top plans at 16 A100s with the memo and without it."""
    cfg = Config(model=ModelConfig(**GPT))
    prob = Problem(cfg.model, Shape.of(cfg.model, 2048), Cluster(2, 8, device("a100", memory_gb=8)), 32, 2048)
    fast = plan(prob, cfg, top_k=8)
    monkeypatch.setattr(search_mod, "enumerate_layouts", functools.partial(enumerate_layouts, remember=False))
    every = plan(prob, cfg, top_k=8)
    assert [(e.layout, e.step_time, e.memory) for e in fast.plans] == \
        [(e.layout, e.step_time, e.memory) for e in every.plans]
    assert (fast.accepted, fast.refused, fast.too_big, fast.simulated) == \
        (every.accepted, every.refused, every.too_big, every.simulated)
