"""Optimus encoder placement as schedule data: the transformed 1F1B / interleaved / zero-bubble
lists are proved by the validator at p in {2, 4}, m in {4, 8}; the validator refuses lists that
break the encoder's dependency rules; the simulated step with the encoder in the bubbles is at
most 0.85x the step with the encoder on stage 0 (encoder cost 15-30% of the LLM's)."""

from __future__ import annotations

import argparse

import pytest

from paratron.config import Config, ConfigError
from paratron.config.loading import set_value
from paratron.pipeline.actions import Action, forward_only
from paratron.pipeline.encoder_schedule import place_encoder
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.simulate_command import add_arguments, run
from paratron.pipeline.simulator import Costs, simulate
from paratron.pipeline.validate import ScheduleError, validate
from paratron.rules import build_config
from paratron.rules import validate as validate_config

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


def _costs(p: int, v: int, share: float, parts: int = 1) -> Costs:
    """Unit F, B, W per stage (1/v per chunk); the encoder costs ``share`` of the LLM's 3p per
    microbatch, a third of it forward."""
    return Costs(F=1 / v, B=1 / v, W=1 / v, EF=share * p, EB=2 * share * p, encoder_parts=parts)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_validator_proves_transformed_lists(schedule, v, p, m):
    base = build_schedule(schedule, p, m, v)
    for placement in ("stage0", "optimus"):
        for parts in ((1, 2) if p == 2 and schedule == "1f1b" else (1,)):
            lists = place_encoder(base, placement, _costs(p, v, 0.2, parts))
            validate(lists, m)
            validate([forward_only(acts) for acts in lists], m, forward_only=True)
            efs = [a for acts in lists for a in acts if a.kind == "EF"]
            assert len(efs) == m * parts
            owners = {r for r, acts in enumerate(lists) for a in acts if a.kind == "EF"}
            assert owners == {0} if placement == "stage0" else len(owners) > 1, (placement, owners)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_validator_proves_dualpipev_with_encoder(p, m):
    """FB pairs: stage 0's forward may be a pair's half; its encoder parts come before the pair."""
    base = build_schedule("dualpipev", p, m, 2)
    for placement in ("stage0", "optimus"):
        validate(place_encoder(base, placement, _costs(p, 2, 0.2)), m)


@pytest.mark.parametrize("schedule,v,share", [("1f1b", 1, 0.15), ("zb-h1", 1, 0.3), ("interleaved", 2, 0.2)])
def test_optimus_step_at_most_085_of_stage0(schedule, v, share):
    p, m = 4, 8
    costs = _costs(p, v, share)
    base = build_schedule(schedule, p, m, v)
    stage0 = simulate(place_encoder(base, "stage0", costs), costs)
    optimus = simulate(place_encoder(base, "optimus", costs), costs)
    plain = simulate(base, costs).makespan
    assert optimus.makespan <= 0.85 * stage0.makespan, (optimus.makespan, stage0.makespan)
    # stage 0 alone carries the encoder in the baseline: its step grows by about the whole encoder
    assert stage0.makespan >= plain + 0.5 * m * 3 * share * p


def _optimus_lists(p=2, m=4):
    return place_encoder(build_schedule("1f1b", p, m), "optimus", _costs(p, 1, 0.2))


def _remote_part(lists):
    return next(a for a in lists[1] if a.kind == "EF")


def _find(acts, kind, mb, stage0=False):
    return next(a for a in acts if a.kind == kind and a.microbatch == mb and (a.stage == 0 or not stage0))


def test_validator_refuses_forward_of_stage0_before_encoder():
    lists = _optimus_lists()
    ef = _remote_part(lists)
    recv, f = _find(lists[0], "RECV_E", ef.microbatch), _find(lists[0], "F", ef.microbatch, stage0=True)
    i, j = lists[0].index(recv), lists[0].index(f)
    lists[0][i], lists[0][j] = f, recv
    with pytest.raises(ScheduleError, match=r"needs every encoder part"):
        validate(lists)


def test_validator_refuses_encoder_backward_before_its_grad():
    lists = _optimus_lists()
    ef = _remote_part(lists)
    eb = _find(lists[1], "EB", ef.microbatch)
    lists[1].remove(eb)
    lists[1].insert(lists[1].index(ef) + 1, eb)
    with pytest.raises(ScheduleError, match=r"encoder backward before the grad"):
        validate(lists)
    # stage 0's rank: EB right after EF, before the stage-0 backward
    lists = place_encoder(build_schedule("1f1b", 2, 4), "stage0", _costs(2, 1, 0.2))
    eb = next(a for a in lists[0] if a.kind == "EB")
    lists[0].remove(eb)
    lists[0].insert(1, eb)
    with pytest.raises(ScheduleError, match=r"encoder backward before the grad"):
        validate(lists)


def test_validator_refuses_missing_or_misplaced_parts():
    lists = _optimus_lists()
    ef = _remote_part(lists)
    lists[1].remove(_find(lists[1], "EB", ef.microbatch))
    with pytest.raises(ScheduleError, match=r"EB\(.*\) is missing"):
        validate(lists)
    lists = _optimus_lists()
    lists[1].remove(ef)
    with pytest.raises(ScheduleError, match=r"EF\(.*\) is missing|before its EF"):
        validate(lists)
    lists = _optimus_lists()
    send = next(a for a in lists[1] if a.kind == "SEND_E")
    k = lists[1].index(send)
    lists[1][k] = Action("SEND_E", send.microbatch, 0, 0, part=send.part + 5)
    with pytest.raises(ScheduleError, match=r"out of range|is missing|carries"):
        validate(lists)


def test_encoder_messages_have_their_own_order():
    """Two encoder outputs sent in one order and received in the other are refused, even though
    the stage messages between the same ranks match."""
    p, m = 2, 4
    lists = place_encoder(build_schedule("1f1b", p, m), "optimus", _costs(p, 1, 0.2, parts=2))
    sends = [i for i, a in enumerate(lists[1]) if a.kind == "SEND_E"]
    assert len(sends) >= 2
    a, b = sends[0], sends[1]
    ea, eb = lists[1][a - 1], lists[1][b - 1]
    assert ea.kind == eb.kind == "EF"
    lists[1][a - 1:a + 1], lists[1][b - 1:b + 1] = lists[1][b - 1:b + 1], lists[1][a - 1:a + 1]
    with pytest.raises(ScheduleError, match=r"same order|carries"):
        validate(lists)


def test_place_encoder_errors():
    base = build_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match="encoder_placement"):
        place_encoder(base, "stage1", Costs())
    with pytest.raises(ValueError, match="parts"):
        place_encoder(base, "optimus", Costs(), parts=0)
    with pytest.raises(ValueError, match="without encoder"):
        place_encoder(place_encoder(base, "stage0", Costs()), "optimus", Costs())
    with pytest.raises(ValueError, match="part"):
        Action("EF", 0, 0)


def test_encoder_placement_config_key():
    cfg = Config()
    assert cfg.parallel.encoder_placement == "stage0"
    set_value(cfg, "parallel.encoder_placement", "optimus")
    assert cfg.parallel.encoder_placement == "optimus"
    with pytest.raises(ConfigError, match="encoder_placement"):
        set_value(cfg, "parallel.encoder_placement", "stage1")


def test_train_refuses_the_optimus_placement_for_text_only_models():
    """The key would be silently ignored by ``paratron train`` (no vision encoder there)."""
    cfg = build_config(None, ["parallel.encoder_placement=optimus"])
    with pytest.raises(ConfigError, match="parallel.encoder_placement='optimus': paratron train builds text-only"):
        validate_config(cfg, 1)
    validate_config(build_config(None, []), 1)


def test_simulate_command_with_encoder(capsys, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "optimus.json"
    args = parser.parse_args(["--pipeline", "4", "--microbatches", "8", "--encoder-placement", "optimus",
                              "--cost-ef", "0.8", "--cost-eb", "1.6", "--output", str(out)])
    assert run(args) == 0
    text = capsys.readouterr().out
    stage0 = float(text.split("encoder on stage 0: makespan ")[1].split()[0])
    optimus = float(text.split("\nmakespan ")[1].split()[0])
    assert optimus <= 0.85 * stage0 and out.exists() and '"EF' in out.read_text()
    bad = parser.parse_args(["--pipeline", "2", "--encoder-placement", "optimus", "--cost-eb", "nan"])
    assert run(bad) == 2
    assert "--cost-eb=nan must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--cost-ef", "0.8"], ["--cost-eb", "1"], ["--encoder-parts", "2"]])
def test_simulate_refuses_encoder_costs_without_a_placement(capsys, flags):
    """Without --encoder-placement these flags were read and dropped: the printed makespan was of a
    model with no encoder, with no word said."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--pipeline", "2", *flags])) == 2
    assert f"{flags[0]} costs a multimodal encoder and needs --encoder-placement" in capsys.readouterr().err


def test_simulate_refuses_encoder_parts_on_stage0(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--pipeline", "4", "--encoder-placement", "stage0", "--encoder-parts", "3"])
    assert run(args) == 2
    assert "--encoder-parts splits each microbatch's encoder work" in capsys.readouterr().err
