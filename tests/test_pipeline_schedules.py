"""Schedules as data: validation over the grid, early errors, simulator closed forms, timelines."""

import json

import pytest

from paratron.pipeline.actions import Action, BW, F, forward_only
from paratron.pipeline.registry import SCHEDULES, build_schedule, default_microbatches, get_schedule
from paratron.pipeline.schedules import with_p2p
from paratron.pipeline.simulator import Costs, simulate
from paratron.pipeline.timeline import draw_png, from_spans, read_chrome_trace, write_chrome_trace
from paratron.pipeline.validate import ScheduleError, validate

BUILTINS = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]


def test_builtins_registered():
    assert set(BUILTINS) <= set(SCHEDULES.names())
    assert get_schedule("zbv").placement(3, 2) == [[0, 5], [1, 4], [2, 3]]
    assert get_schedule("interleaved").placement(2, 2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("name", BUILTINS)
def test_grid_validates(name):
    """Every accepted (p <= 8, m <= 16, v <= 4) validates; every rejection comes from the check."""
    spec = get_schedule(name)
    accepted = 0
    for p in range(1, 9):
        for m in range(1, 17):
            for v in range(1, 5):
                try:
                    spec.check(p, m, v)
                except ValueError:
                    with pytest.raises(ValueError):
                        build_schedule(name, p, m, v)
                    continue
                lists = build_schedule(name, p, m, v)
                validate(lists, m)
                validate([forward_only(a) for a in lists], m, forward_only=True)
                accepted += 1
    # The checks reject only what the rules say: one chunk (or V's two), and m % p for interleaving.
    expected = 3 * sum(16 // p for p in range(1, 9)) if name == "interleaved" else 8 * 16
    assert accepted == expected


@pytest.mark.parametrize("name", BUILTINS)
def test_default_microbatches_valid(name):
    for p in range(1, 9):
        v = 2 if name in ("interleaved", "zbv") else 1
        validate(build_schedule(name, p, default_microbatches(p), v))


@pytest.mark.parametrize("name,p,m,v,rule", [
    ("interleaved", 4, 6, 2, "multiple of the pipeline size"),
    ("interleaved", 2, 4, 1, "v >= 2"),
    ("1f1b", 2, 4, 2, "one model chunk per rank"),
    ("zbv", 2, 4, 3, "exactly 2 chunks"),
    ("gpipe", 0, 4, 1, "pipeline size p=0"),
    ("zb-h1", 2, 0, 1, "microbatches m=0"),
])
def test_unsupported_rejected_with_rule(name, p, m, v, rule):
    with pytest.raises(ValueError, match=rule):
        build_schedule(name, p, m, v)


def test_unknown_schedule_lists_names():
    with pytest.raises(ValueError, match="known: .*1f1b"):
        build_schedule("1f1c", 2, 4, 1)


def test_validator_catches_deadlock():
    # Rank 0 waits for rank 1's grad before sending it the activation rank 1 needs first.
    lists = [[F(0, 0), Action("RECV_B", 0, 0, 1), BW(0, 0), Action("SEND_F", 0, 0, 1)],
             [Action("RECV_F", 0, 1, 0), F(0, 1), BW(0, 1), Action("SEND_B", 0, 1, 0)]]
    with pytest.raises(ScheduleError, match="deadlock: rank 0 .*RECV_B0@s0<-1.*rank 1 .*RECV_F0@s1<-0"):
        validate(lists)


def test_validator_catches_unmatched_and_misordered():
    ok = with_p2p([[F(0, 0), F(1, 0), BW(0, 0), BW(1, 0)], [F(0, 1), BW(0, 1), F(1, 1), BW(1, 1)]])
    validate(ok)
    lost = [list(ok[0]), [a for a in ok[1] if a.kind != "SEND_B" or a.microbatch != 1]]
    with pytest.raises(ScheduleError):
        validate(lost)
    # Receiving microbatch 1 before 0 from the same peer swaps tensors: rejected.
    swapped = [ok[0], [Action("RECV_F", 1, 1, 0) if a == Action("RECV_F", 0, 1, 0) else
                       Action("RECV_F", 0, 1, 0) if a == Action("RECV_F", 1, 1, 0) else a for a in ok[1]]]
    with pytest.raises(ScheduleError):
        validate(swapped)
    extra = [ok[0] + [Action("SEND_F", 1, 0, 1)], ok[1]]
    with pytest.raises(ScheduleError, match="duplicate"):
        validate(extra)


def test_validator_catches_local_order_and_missing_w():
    with pytest.raises(ScheduleError, match="backward before its forward"):
        validate([[BW(0, 0), F(0, 0)]])
    with pytest.raises(ScheduleError, match="has no W"):
        validate([[F(0, 0), Action("B", 0, 0)]])
    with pytest.raises(ScheduleError, match="order of its B"):
        validate([[F(0, 0), F(1, 0), Action("B", 0, 0), Action("B", 1, 0), Action("W", 1, 0), Action("W", 0, 0)]])


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_1f1b_closed_forms(p, m):
    r = simulate(build_schedule("1f1b", p, m), Costs(F=1, B=1, W=1))
    for rank in range(p):
        assert r.bubble[rank] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert r.peak_in_flight[rank] == min(p - rank, m)
    assert r.makespan == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 16), (8, 8), (8, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_closed_form(p, m, v):
    r = simulate(build_schedule("interleaved", p, m, v), Costs(F=1 / v, B=1 / v, W=1 / v))
    for b in r.bubble:
        assert b == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 8), (8, 16)])
@pytest.mark.parametrize("costs", [(1, 1, 1), (2, 2, 1), (1, 2, 1)])
def test_zb_h1_idle_closed_form(p, m, costs):
    f, b, w = costs
    zb = simulate(build_schedule("zb-h1", p, m), Costs(F=f, B=b, W=w))
    base = simulate(build_schedule("1f1b", p, m), Costs(F=f, B=b, W=w))
    for rank in range(p):
        assert zb.idle[rank] == pytest.approx((p - 1) * (f + b - w))
        assert base.idle[rank] == pytest.approx((p - 1) * (f + b + w))
    if costs == (1, 1, 1):
        assert zb.idle[0] / base.idle[0] == pytest.approx(1 / 3)


def test_zbv_beats_1f1b_at_equal_work():
    p, m = 4, 8
    zbv = simulate(build_schedule("zbv", p, m, 2), Costs(F=0.5, B=0.5, W=0.5))
    base = simulate(build_schedule("1f1b", p, m), Costs(F=1, B=1, W=1))
    assert max(zbv.bubble) < 0.5 * min(base.bubble)


def test_latency_delays_makespan():
    lists = build_schedule("1f1b", 4, 8)
    assert simulate(lists, Costs(latency=0.5)).makespan > simulate(lists, Costs()).makespan


def test_timeline_files(tmp_path):
    result = simulate(build_schedule("interleaved", 2, 4, 2))
    events = from_spans(result.spans)
    assert len(events) == 2 * 2 * 4 * 2  # F and BW per (mb, chunk) on each rank
    path = write_chrome_trace(events, tmp_path / "t.json")
    data = json.loads(path.read_text())
    assert {e["tid"] for e in data["traceEvents"] if e["ph"] == "X"} == {0, 1}
    back = read_chrome_trace(path)
    assert [(e.kind, e.microbatch, e.stage) for e in back] == [(e.kind, e.microbatch, e.stage) for e in events]
    pytest.importorskip("matplotlib")
    png = draw_png(events, tmp_path / "t.png", title="interleaved")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_command(tmp_path, capsys):
    from paratron.cli import main

    out = tmp_path / "zb.json"
    assert main(["simulate", "--schedule", "zb-h1", "--pipeline", "4", "--microbatches", "8",
                 "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rank 3: bubble 0.1111" in text
    assert out.exists()
    assert main(["simulate", "--schedule", "interleaved", "--pipeline", "4", "--microbatches", "6"]) == 2
    assert "multiple of the pipeline size" in capsys.readouterr().err


def _early_backward_on_rank_0(p, m, v):
    """Broken on purpose: rank 0 waits for microbatch 0's grad before sending microbatch 0's
    activation, which the grad needs."""
    lists = build_schedule("gpipe", p, m, v)
    early = [a for a in lists[0] if a.microbatch == 0 and a.kind in ("RECV_B", "BW")]
    rest = [a for a in lists[0] if a not in early]
    lists[0] = rest[:1] + early + rest[1:]
    return lists


def test_broken_custom_schedule_fails_at_build_time():
    SCHEDULES.register("broken", _early_backward_on_rank_0, replace=True)
    try:
        with pytest.raises(ScheduleError, match="deadlock"):
            build_schedule("broken", 2, 2, 1)
        assert len(build_schedule("broken", 2, 2, 1, check=False)) == 2
    finally:
        SCHEDULES.unregister("broken")


def test_stage_layers_even_layout_and_v_placement():
    from paratron.pipeline.partition import chunk_stages, stage_layers

    assert stage_layers(8, 2, 2, None, "interleaved") == {(0, 0): (0, 2), (1, 0): (2, 2), (0, 1): (4, 2),
                                                          (1, 1): (6, 2)}
    # Embedding-only first stage and head-only last stage; zbv puts both on rank 0 (V shape).
    zbv = stage_layers(8, 2, 2, [0, 4, 4, 0], "zbv")
    assert zbv == {(0, 0): (0, 0), (1, 0): (0, 4), (1, 1): (4, 4), (0, 1): (8, 0)}
    assert list(zbv) == [(0, 0), (1, 0), (1, 1), (0, 1)]  # model order
    assert stage_layers(6, 3, 1, [1, 4, 1], "1f1b") == {(0, 0): (0, 1), (1, 0): (1, 4), (2, 0): (5, 1)}
    assert chunk_stages(4, 2, "zbv", 1) == [1, 6] and chunk_stages(4, 2, "interleaved", 1) == [1, 5]
    with pytest.raises(ValueError, match="not divisible by parallel.pipeline\\*virtual_pipeline = 4\\*1 = 4"):
        stage_layers(6, 4, 1, None, "1f1b")
    with pytest.raises(ValueError, match="has 1 entries; it needs parallel.pipeline\\*virtual_pipeline = 2"):
        stage_layers(8, 2, 1, [8], "1f1b")
    with pytest.raises(ValueError, match="sum to model.num_layers=8"):
        stage_layers(8, 2, 1, [3, 4], "1f1b")
    with pytest.raises(ValueError, match="non-negative"):
        stage_layers(8, 2, 1, [-1, 9], "1f1b")


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zbv_memory_bound(p):
    """ZBV keeps at most 2p chunk activations in flight per rank (1F1B's first-rank memory)."""
    for m in (1, 4, 8, 16):
        assert max(simulate(build_schedule("zbv", p, m, 2)).peak_in_flight) <= 2 * p
