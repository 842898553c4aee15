"""Observability on demand: torch.profiler traces and memory snapshots of chosen steps
(``train.profile_steps``, ``profile_ranks``, ``memory_snapshot_steps``), the measured pipeline
timeline as Chrome trace-event JSON (``train.timeline_steps``) next to ``paratron simulate
--trace``, and Weights & Biases offline (``train.wandb_project``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from paratron.config import ConfigError, megatron_overrides
from paratron.rules import build_config, validate
from paratron.parallel.context import ParallelContext
from paratron.parallel.profiling import labelled, profiler_enabled
from paratron.pipeline.actions import Action
from paratron.pipeline.runtime import run_pipeline
from paratron.local_ranks import run_ranks
from paratron.training.profiling import ProfiledRecorder, StepObserver, tensor_inventory

from helpers import config_with
from test_e2e_train import TINY, _train_in_rank
from test_moe_overlap import _Timed

PROBE = '''
import json
from paratron.parallel.profiling import profiler_enabled
from paratron.training.callbacks import Callback


class ProfilerProbe(Callback):
    """Whether a profiler collects at each step's start and end (this rank)."""

    def __init__(self, state):
        self.path, self.seen = state.run_dir / f"probe_{state.ctx.rank}.json", []

    def on_step_start(self, state):
        self.seen.append([state.iteration + 1, "start", profiler_enabled()])

    def on_step_end(self, state, metrics, timings):
        self.seen.append([state.iteration, "end", profiler_enabled()])
        self.path.write_text(json.dumps(self.seen))
'''


@pytest.fixture(scope="module")
def tiny_data(tiny_corpus):
    return tiny_corpus + ["data.split=90,10,0"]


def _train(tmp_path: Path, data: list[str], world: int, extra: list[str]) -> Path:
    run_dir = tmp_path / "run"
    argv = ["train", "--run-dir", str(run_dir)]
    for o in TINY + data + ["train.eval_iters=0", "train.sample_tokens=0"] + extra:  # no evaluation, no sample
        argv += ["--set", o]
    assert run_ranks(_train_in_rank, world, argv, timeout=300) == [0] * world
    return run_dir


def _complete_events(path: Path) -> list[dict]:
    """The trace's complete ("X") events, after checking the trace-event schema of every event."""
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    assert isinstance(events, list) and events
    for e in events:
        assert isinstance(e.get("name"), str) and isinstance(e.get("ph"), str)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert "pid" in e and "tid" in e
    return [e for e in events if e["ph"] == "X"]


def _order(events: list[dict]) -> dict[int, list[tuple]]:
    """Per track, the actions of a timeline trace (compute and p2p; pid 0) in time order (the
    p2p actions of one batch share a start: the sort is stable, and both files list them in
    the schedule's order)."""
    out: dict[int, list[tuple]] = {}
    for e in sorted((e for e in events if e["pid"] == 0), key=lambda e: e["ts"]):
        out.setdefault(e["tid"], []).append((e["cat"], e["args"]["microbatch"], e["args"]["stage"]))
    return out


# ---- TP2 x PP2: profiler traces, the step timeline against the simulator ---------------------------
def test_profile_steps_tp2_pp2_and_timeline_matches_simulation(tiny_data, tmp_path):
    """4 steps at TP2 x PP2 (1F1B, 4 microbatches): profile_steps=[2, 3] writes one Chrome trace
    per rank holding F and BW of every microbatch on that rank's stage, twice (steps 2 and 3
    only); the profiler is off at the start of step 2 and after step 3 (a probe callback). Step
    2's measured timeline has the simulated 1F1B's action order on every rank."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    run_dir = _train(tmp_path, tiny_data, 4, [
        "train.train_iters=4", "parallel.tensor=2", "parallel.pipeline=2", "parallel.schedule=1f1b",
        "train.profile_steps=[2,3]", "train.timeline_steps=[2]", "train.memory_snapshot_steps=[4]",
        f'train.callbacks=["{probe}:ProfilerProbe"]'])
    traces = sorted((run_dir / "profile").glob("*.json"))
    assert [p.name for p in traces] == [f"rank_{r}.json" for r in range(4)]
    timeline = _complete_events(run_dir / "timeline" / "step_2.json")
    stage_of = {tid: acts[0][2] for tid, acts in _order(timeline).items()}  # v = 1: stage = pp rank
    assert sorted(stage_of) == [0, 1, 2, 3] and sorted(stage_of.values()) == [0, 0, 1, 1]
    for rank, path in enumerate(traces):
        names = [e["name"] for e in _complete_events(path)]
        s = stage_of[rank]
        for mb in range(4):
            assert names.count(f"F mb{mb} stage{s}") == 2, (rank, mb)   # steps 2 and 3, not 1 or 4
            assert names.count(f"BW mb{mb} stage{s}") == 2, (rank, mb)
        assert "step 2" in names and "step 3" in names and "step 1" not in names and "step 4" not in names
        seen = json.loads((run_dir / f"probe_{rank}.json").read_text())
        assert seen == [[1, "start", False], [1, "end", False], [2, "start", False], [2, "end", True],
                        [3, "start", True], [3, "end", False], [4, "start", False], [4, "end", False]]
        inventory = json.loads((run_dir / "memory" / f"rank_{rank}_step_4.json").read_text())
        assert inventory["step"] == 4 and inventory["by_device"]["cpu"] == inventory["total_bytes"] > 0
        assert any(t["kind"] == "parameter" for t in inventory["tensors"])

    from paratron.cli import main

    assert main(["simulate", "--schedule", "1f1b", "--pipeline", "2", "--microbatches", "4",
                 "--trace", str(tmp_path / "plan.json")]) == 0
    planned = _order(_complete_events(tmp_path / "plan.json"))
    measured = _order(timeline)
    for tid, acts in measured.items():
        assert acts == planned[stage_of[tid]], tid


# ---- DP2: bucket reductions in the timeline, wandb offline ----------------------------------------
def _wandb_history(run_dir: Path) -> tuple[list[dict], dict]:
    """The history rows and the config of the one offline wandb run under ``run_dir``, read from
    its transaction log (LevelDB log framing: 32 KiB blocks of [crc32, length, type] + data)
    with wandb's own protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    raw, pos, block, part, rows, config = path.read_bytes(), 7, 32768, b"", [], {}
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data, pos = raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (2, 3):  # first / middle piece of a record
            part += data
            continue
        if kind == 0:
            continue
        rec = pb.Record()
        rec.ParseFromString(part + data)
        part = b""
        if rec.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
        elif rec.WhichOneof("record_type") == "run":
            config = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.run.config.update}
    return rows, config


def test_wandb_offline_and_bucket_reductions_dp2(tiny_data, tmp_path, monkeypatch):
    """DP2, 3 steps, WANDB_MODE=offline: the run directory's wandb run holds the loss history of
    metrics.jsonl and the config; step 2's timeline has each rank's DP bucket reductions."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = _train(tmp_path, tiny_data, 2, ["train.train_iters=3", "train.timeline_steps=[2]",
                                              "train.wandb_project=paratron-test", "train.wandb_exp_name=dp2"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    rows, config = _wandb_history(run_dir)
    assert {r["_step"]: r["loss"] for r in rows if "loss" in r} == pytest.approx(losses)
    assert len(losses) == 3 and config["train"]["train_iters"] == 3 and config["parallel"]["tensor"] == 1
    events = _complete_events(run_dir / "timeline" / "step_2.json")
    reductions = [e for e in events if e["cat"] == "bucket_reduce"]
    assert {e["tid"] for e in reductions} == {0, 1} and all(e["pid"] == 2 for e in reductions)


# ---- one process ------------------------------------------------------------------------------------
def test_step_timeline_matches_the_runtime_events_one_to_one(tmp_path):
    """The exported step_N.json holds exactly the runtime's events (actions and the intervals
    recorded inside them) plus the intervals recorded after the pipeline call (here a stand-in
    for a bucket reduction waited after it), each once, with the same names and times."""
    ctx = ParallelContext.single()
    observer = StepObserver(config_with(train__timeline_steps=[1]), ctx, tmp_path)
    chunk = _Timed(ctx)
    actions = [Action("F", 0, 0), Action("F", 1, 0), Action("BW", 0, 0), Action("BW", 1, 0)]
    with observer.step(1) as timeline:
        run_pipeline(actions, [chunk], ctx, [torch.arange(4.0)] * 2, lambda c, m, x, mb: m(mb).sum(), [4],
                     torch.float32, timeline=timeline)
        after = ctx.ledger.intervals.issued("bucket_reduce", None)
    assert ctx.ledger.intervals is None
    assert len(timeline) == 8  # 4 actions, 4 intervals (forward and backward of each F)
    exported = _complete_events(tmp_path / "timeline" / "step_1.json")
    ours = [(e.kind, e.microbatch, e.stage, e.lane, e.start * 1e6, e.end * 1e6) for e in timeline]
    ours.append(("bucket_reduce", -1, -1, "comm", (after.start - timeline.origin) * 1e6,
                 (after.end - timeline.origin) * 1e6))
    lanes = {0: "", 1: "compute", 2: "comm"}
    theirs = [(e["cat"], e["args"]["microbatch"], e["args"]["stage"], lanes[e["pid"]], e["ts"], e["ts"] + e["dur"])
              for e in exported]
    assert len(theirs) == len(ours) == 9
    for a, b in zip(sorted(theirs), sorted(ours)):
        assert a[:4] == b[:4] and a[4:] == pytest.approx(b[4:], abs=1e-3)  # microseconds
    assert {e["name"] for e in exported} >= {"F mb0 stage0", "BW mb1 stage0", "experts_grad mb1 stage0",
                                             "bucket_reduce"}


def test_steps_outside_every_range_install_nothing(tmp_path):
    ctx = ParallelContext.single()
    observer = StepObserver(config_with(train__profile_steps=[2, 2], train__timeline_steps=[3]), ctx, tmp_path)
    with observer.step(1) as timeline:
        assert timeline is None and ctx.ledger.intervals is None and not profiler_enabled()
    with observer.step(1, record=True) as timeline:  # the trainer's own need (1f1b-delay's measurement)
        assert timeline == [] and ctx.ledger.intervals is not None and not profiler_enabled()
    assert not (tmp_path / "timeline").exists()
    with observer.step(2) as timeline:
        assert profiler_enabled()
    assert not profiler_enabled() and (tmp_path / "profile" / "rank_0.json").exists()


def test_labelled_opens_a_range_only_while_profiling():
    assert labelled("F mb0 stage0") is labelled("B mb1 stage0")  # one shared no-op context
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with labelled("F mb0 stage0"):
            torch.ones(2).sum()
    assert "F mb0 stage0" in {e.key for e in prof.key_averages()}


def test_profiled_recorder_names_its_ranges_by_the_running_action():
    """Each recorded interval becomes a profiler range named by its kind and the action's scope:
    a comm one from issue to the program's wait (here across the expert compute it overlaps)."""
    rec = ProfiledRecorder()
    rec.scope = (3, 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flight = rec.issued("dispatch", None)  # a size-1 group: complete at once
        late = rec.open("combine", comm=True)
        with rec.compute("experts"):
            torch.ones(4).sum()
        rec.waited(late)
    names = {e.key for e in prof.key_averages()}
    assert {"dispatch mb3 stage1", "combine mb3 stage1", "experts mb3 stage1"} <= names
    assert flight.end is not None and late.waited is not None and not rec._ranges


def test_tensor_inventory_counts_each_storage_once():
    big = torch.zeros(1000, dtype=torch.float64)
    view = big[10:20]  # noqa: F841  (a view: no new bytes)
    param = torch.nn.Parameter(torch.zeros(3, 5))  # noqa: F841
    inv = tensor_inventory()
    rows = {(tuple(t["shape"]), t["dtype"], t["kind"]): t for t in inv["tensors"]}
    assert rows[((1000,), "float64", "tensor")]["bytes"] >= 8000
    assert rows[((10,), "float64", "tensor")]["bytes"] == 0 or rows[((1000,), "float64", "tensor")]["bytes"] == 0
    assert rows[((3, 5), "float32", "parameter")]["bytes"] == 60
    assert inv["total_bytes"] == sum(t["bytes"] for t in inv["tensors"])


# ---- config -----------------------------------------------------------------------------------------
def _megatron(argv: list[str]):
    overrides, rest = megatron_overrides(argv)
    assert rest == []
    return build_config(None, overrides)


def test_megatron_profiler_and_wandb_flags():
    cfg = _megatron(["--profile-step-start", "3", "--profile-step-end", "5", "--profile-ranks", "0", "2",
                     "--wandb-project", "proj", "--wandb-exp-name", "run1"])
    # Megatron's torch profiler is active for end - start steps from start: steps 3 and 4.
    assert cfg.train.profile_steps == [3, 4] and cfg.train.profile_ranks == [0, 2]
    assert (cfg.train.wandb_project, cfg.train.wandb_exp_name) == ("proj", "run1")
    assert _megatron(["--use-pytorch-profiler"]).train.profile_steps == [10, 11]  # Megatron's defaults
    assert _megatron([]).train.profile_steps == []
    with pytest.raises(ConfigError, match="profile-step-end=3"):
        _megatron(["--profile-step-start", "3", "--profile-step-end", "3"])


@pytest.mark.parametrize("fields,msg", [
    (dict(train__profile_steps=[3, 2]), r"train.profile_steps=\[3, 2\] must be \[start, end\]"),
    (dict(train__profile_steps=[0]), r"train.profile_steps=\[0\]"),
    (dict(train__timeline_steps=[0]), "train.timeline_steps"),
    (dict(train__memory_snapshot_steps=[-1]), "train.memory_snapshot_steps"),
    (dict(train__profile_ranks=[1]), r"train.profile_ranks=\[1\]: ranks \[1\]"),
])
def test_observability_rules(fields, msg):
    with pytest.raises(ConfigError, match=msg):
        validate(config_with(**fields), 1)


def test_missing_wandb_is_refused_before_launch_naming_the_extra(monkeypatch, capsys):
    import importlib.util

    from paratron.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'paratron\[wandb\]'"):
        validate(config_with(train__wandb_project="p"), 1)
    assert main(["train", "--set", "train.wandb_project=p"]) == 2
    assert "paratron[wandb]" in capsys.readouterr().err
