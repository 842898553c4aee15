"""DualPipeV (paratron/pipeline/dualpipev.py) as action lists: the validator proves them, the
order is PyTorch's published ``ScheduleDualPipeV`` order (written out by hand below), the
weight grads it defers are W actions, and the simulator costs it against ZBV and 1F1B. Parity of
a training run under it is in tests/test_mla_mtp.py."""

from __future__ import annotations

import re

import pytest

from paratron.pipeline import schedules
from paratron.pipeline.actions import FB, Action, activation_peak
from paratron.pipeline.overlap import DEFAULT_COSTS
from paratron.pipeline.placement import v_placement
from paratron.pipeline.registry import build_schedule, get_schedule
from paratron.pipeline.simulator import Costs, simulate
from paratron.pipeline.timeline import from_spans, write_chrome_trace
from paratron.pipeline.validate import validate

# torch.distributed.pipelining.ScheduleDualPipeV's compute order per rank (FULL_BACKWARD = BW,
# BACKWARD_INPUT = B, BACKWARD_WEIGHT = W, OVERLAP_F_B = FB(forward, backward)), worked out by
# hand from its eight steps: "Fm@s" is microbatch m on stage s.
PUBLISHED = {
    (2, 4): [
        "F0@0 F1@0 F2@0 F0@3 B0@3 W0@3 F1@3 FB(F3@0,BW1@3) FB(F2@3,BW0@0) BW2@3 FB(F3@3,BW1@0) BW3@3 "
        "B2@0 W2@0 B3@0 W3@0",
        "F0@1 F0@2 F1@1 F1@2 F2@1 BW0@2 FB(F2@2,BW0@1) FB(F3@1,BW1@2) FB(F3@2,BW1@1) BW2@2 BW2@1 "
        "B3@2 B3@1 W3@2 W3@1",
    ],
}
# p=4, m=8, rank 3 (the turn of the V: stages 3 and 4).
PUBLISHED_P4_M8_RANK3 = (
    "F0@3 F0@4 F1@3 F1@4 F2@3 F2@4 F3@3 F3@4 F4@3 BW0@4 FB(F4@4,BW0@3) FB(F5@3,BW1@4) FB(F5@4,BW1@3) "
    "FB(F6@3,BW2@4) FB(F6@4,BW2@3) FB(F7@3,BW3@4) FB(F7@4,BW3@3) BW4@4 BW4@3 BW5@4 BW5@3 B6@4 B6@3 "
    "B7@4 B7@3 W6@4 W6@3 W7@4 W7@3")


def _parse(text: str) -> list[Action]:
    def one(tok: str) -> Action:
        kind, mb, s = re.fullmatch(r"(BW|F|B|W)(\d+)@(\d+)", tok).groups()
        return Action(kind, int(mb), int(s))

    out = []
    for tok in text.split():
        pair = re.fullmatch(r"FB\((\S+),(\S+)\)", tok)
        out.append(FB(one(pair[1]), one(pair[2])) if pair else one(tok))
    return out


def _compute(lists):
    return [[a for a in acts if not a.is_p2p] for acts in lists]


def test_registered_with_v_placement_and_two_chunks():
    spec = get_schedule("dualpipev")
    assert spec.virtual_stages == 2 and spec.placement(4, 2) == v_placement(4, 2)
    with pytest.raises(ValueError, match="at least as many microbatches as stages: m=7 < 2p=8"):
        build_schedule("dualpipev", 4, 7, 2)
    with pytest.raises(ValueError, match="virtual stages v=3 must be 2"):
        build_schedule("dualpipev", 4, 8, 3)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("factor", [2, 4])
def test_validator_proves_lists(p, factor):
    """The lists for p in {2, 4, 8} and m in {2p, 4p} pass the validator (complete, ordered,
    matched p2p, no deadlock), FB pairs included; weight grads are deferred (B then W) in the
    warm-up and the cool-down, and every rank holds at most 2p+1 chunk activations."""
    m = factor * p
    lists = build_schedule("dualpipev", p, m, 2)
    validate(lists, m)
    kinds = {a.kind for acts in lists for a in acts}
    assert {"F", "B", "W", "BW", "FB"} <= kinds
    assert max(activation_peak(acts) for acts in lists) == 2 * p + 1
    assert all(acts and sum(a.kind == "FB" for a in acts) >= m - 2 * p + 1 for acts in lists)


@pytest.mark.parametrize("p, m", sorted(PUBLISHED))
def test_matches_published_order(p, m):
    assert _compute(build_schedule("dualpipev", p, m, 2)) == [_parse(t) for t in PUBLISHED[(p, m)]]


def test_matches_published_order_turn_rank():
    assert _compute(build_schedule("dualpipev", 4, 8, 2))[3] == _parse(PUBLISHED_P4_M8_RANK3)


def test_published_order_is_checked():
    """The comparison can fail: a swapped pair in the written-out order is a different list."""
    text = PUBLISHED[(2, 4)][0].replace("B2@0 W2@0 B3@0", "B3@0 W2@0 B2@0")
    assert _compute(build_schedule("dualpipev", 2, 4, 2))[0] != _parse(text)


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("factor", [2, 4])
def test_simulated_makespan_at_most_zbv_at_equal_memory(p, factor):
    """With the F/B overlap it is built for (a quarter of F and of B waiting on all-to-alls,
    ``overlap.DEFAULT_COSTS``), DualPipeV's simulated step is no longer than ZBV's built with
    the same activation budget (2p+1) nor 1F1B's (chunks of half a stage). Without any
    comm to hide (F = B = W) it is not: e.g. 54 against 51 at p=4, m=8 (benchmarks/README.md)."""
    m = factor * p
    dpv = build_schedule("dualpipev", p, m, 2)
    budget = max(activation_peak(acts) for acts in dpv)
    zbv = schedules.with_p2p(schedules.greedy_zero_bubble(v_placement(p, 2), m, limit=budget))
    d, z = simulate(dpv, DEFAULT_COSTS), simulate(zbv, DEFAULT_COSTS)
    assert max(activation_peak(acts) for acts in zbv) <= budget
    assert d.makespan <= z.makespan
    stage = Costs(F=2, B=2, W=2, comm_F=0.5, comm_B=0.5)
    assert d.makespan < simulate(build_schedule("1f1b", p, m), stage).makespan


def test_simulate_command_defaults_to_two_chunks(capsys):
    from paratron.cli import main

    assert main(["simulate", "--schedule", "dualpipev", "--pipeline", "4", "--microbatches", "8",
                 "--comm-f", "0.25", "--comm-b", "0.25"]) == 0
    text = capsys.readouterr().out
    assert "p=4 m=8 v=2" in text and "makespan 49" in text


def test_timeline_draws_pairs(tmp_path):
    lists = build_schedule("dualpipev", 2, 4, 2)
    events = from_spans(simulate(lists, DEFAULT_COSTS).spans)
    write_chrome_trace(events, tmp_path / "dualpipev.json")
    assert (tmp_path / "dualpipev.json").stat().st_size > 0
    assert any(e.kind == "FB" for e in events)


def test_zero3_refused_before_launch():
    """ZeRO-3 frees a layer's params after its forward and backward; DualPipeV's pairs run one
    microbatch's backward inside another's forward, so the config is refused, naming both."""
    from paratron.config import Config, ConfigError
    from paratron.rules import validate

    cfg = Config()
    cfg.model.num_layers = 4
    p = cfg.parallel
    p.pipeline, p.virtual_pipeline, p.schedule, p.zero = 2, 2, "dualpipev", 3
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 1, 8
    with pytest.raises(ConfigError, match="parallel.schedule='dualpipev'.*parallel.zero=3"):
        validate(cfg, 4)
    p.zero = 1
    validate(cfg, 4)
