"""Online pipeline re-layout (paratron/elastic/relayout.py): PP=2 [2,2] -> [1,3] after step 3
of 6, in memory, gives the losses and final params of the uninterrupted run bitwise, writes no
file under the checkpoint directory, and a request that does not fit is refused with the run
going on unchanged."""

from __future__ import annotations

import json
import threading
import time
import os
from pathlib import Path

import pytest
import torch

from paratron import cli
from paratron.checkpoint.items import model_items
from paratron.checkpoint.manager import full_params
from paratron.elastic.relayout import (RelayoutRefused, check_request, read_answer, take_request_file, write_answer,
                                      write_request)
from paratron.local_ranks import run_ranks
from paratron.rules import load_config
from paratron.training.callbacks import Callback

PLAN = "PARATRON_TEST_RELAYOUT"  # json: {"refuse_at": step, "file_at": step, "layout": [...]}

TINY = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.seq_length=16", "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_iters=6",
    "train.eval_interval=0", "train.deterministic=true", "train.seed=11",
    "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=2", "optimizer.clip_grad=0.0",  # see test_relayout_in_memory_is_bitwise
    "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false",
    "train.sample_tokens=0", "train.elastic_relayout=true", "parallel.pipeline=2", "train.callbacks=test_elastic_relayout:Probe",
]


class Probe(Callback):
    """Records the layout and the checkpoint directory's files at each step start, asks for a
    bad layout through ``state.request_relayout`` and drops a good one as ``paratron resize``
    does (per ``$PARATRON_TEST_RELAYOUT``), and saves this rank's final params."""

    def __init__(self, state):
        self.plan = json.loads(os.environ.get(PLAN, "{}"))
        self.seen = []

    def on_step_start(self, state):
        ck = Path(state.run_dir) / "ck"
        self.seen.append({"iteration": state.iteration, "layout": state.config.parallel.pipeline_layout,
                          "ck_files": sorted(str(p) for p in ck.rglob("*")) if ck.exists() else []})

    def on_step_end(self, state, metrics, timings):
        if state.iteration == self.plan.get("refuse_at"):
            state.request_relayout([1, 2])  # sums to 3, not model.num_layers=4
        if state.iteration == self.plan.get("file_at") and state.ctx.rank == 0:
            write_request(state.run_dir, self.plan["layout"], id="probe")

    def on_train_end(self, state):
        with full_params(state.optimizer):  # ZeRO-3: the params are gathered for the block
            items = model_items(state.chunks, is_first_stage=state.ctx.is_first_stage)
            # keyed by the chunk's place in the full tensor too: TP ranks hold other chunks
            params = {(k, c.offsets): c.tensor.clone() for k, chunks in items.items() for c in chunks}
        torch.save({"params": params, "seen": self.seen}, Path(state.run_dir) / f"probe_{state.ctx.rank}.pt")


def _train(overrides: list[str], run_dir: str, plan: dict) -> int:
    import paratron.launch.runner as runner

    os.environ[PLAN] = json.dumps(plan)
    return runner.run_training(load_config(None, overrides), run_dir)


def _run(tmp_path, name, overrides, plan=None, world=2):
    run_dir = tmp_path / name
    assert run_ranks(_train, world, overrides, str(run_dir), plan or {}, timeout=300) == [0] * world
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    probes = [torch.load(run_dir / f"probe_{r}.pt") for r in range(world)]
    params = {k: v for p in probes for k, v in p["params"].items()}
    return losses, params, [p["seen"] for p in probes]


def _assert_same(a, b, what):
    losses_a, params_a, _ = a
    losses_b, params_b, _ = b
    assert sorted(losses_a) == [1, 2, 3, 4, 5, 6]
    assert losses_a == losses_b, f"{what}: losses {losses_a} vs {losses_b}"
    assert params_a.keys() == params_b.keys()
    for k in params_a:
        assert torch.equal(params_a[k], params_b[k]), f"{what}: {k}"


@pytest.mark.parametrize("world, extra", [
    (2, []),
    pytest.param(4, ["parallel.zero=1"], marks=pytest.mark.slow, id="dp2-zero1"),  # slices from 2 DP ranks
])
def test_relayout_in_memory_is_bitwise(tiny_corpus, tmp_path, world, extra):
    """Gradient clipping is off: its global norm sums each stage's squares first, so a different
    split rounds the norm differently and, once clipping is active, the updates differ in the
    last bits (clip_grad=1.0: [2,2] and [1,3] part at step 4's loss, 6.07082986831665 vs
    6.070829749107361). The re-layout itself changes nothing else."""
    base = TINY + tiny_corpus + ["data.split=100,0,0", *extra]
    even = _run(tmp_path, "even", base + ["parallel.pipeline_layout=2,2"], world=world)
    uneven = _run(tmp_path, "uneven", base + ["parallel.pipeline_layout=1,3"], world=world)
    _assert_same(even, uneven, "[2,2] vs [1,3] uninterrupted")  # the split does not change the math
    _check_moved(tmp_path, base, even, world)


def _check_moved(tmp_path, base, even, world):
    """Run [2,2] re-laid out to [1,3] after step 3 (a bad request refused after step 2) and check
    it against the uninterrupted ``even`` run: losses and final params bitwise, the layout of
    each step, and no file written under the checkpoint directory by the re-layout."""
    ck = tmp_path / "moved" / "ck"
    moved = _run(tmp_path, "moved", base + ["parallel.pipeline_layout=2,2", f"checkpoint.save={ck}"],
                 {"refuse_at": 2, "file_at": 3, "layout": [1, 3]}, world=world)
    _assert_same(even, moved, "[2,2] -> [1,3] after step 3")
    for seen in moved[2]:
        layouts = {s["iteration"]: s["layout"] for s in seen}
        # keyed by completed steps at each step's start: steps 1-3 at [2,2], 4-6 at [1,3]
        assert layouts == {0: [2, 2], 1: [2, 2], 2: [2, 2], 3: [1, 3], 4: [1, 3], 5: [1, 3]}, layouts
        assert all(s["ck_files"] == [] for s in seen), seen  # the re-layout wrote nothing there
    assert not (tmp_path / "moved" / "relayout_request.json").exists()  # taken once
    answer = read_answer(tmp_path / "moved", "probe")  # what paratron resize waits for
    assert answer["outcome"] == "applied" and "pipeline_layout=[1, 3] from iteration 3" in answer["message"], answer
    assert (ck / "latest").read_text().strip() == "step_6"  # the final save, at the new layout


@pytest.mark.parametrize("extra", [
    # TP2 x PP2: TP-sharded rectangles, the vocab padded to 32 rows per TP rank pair
    pytest.param(["parallel.tensor=2", "parallel.sequence_parallel=true"], id="tp2-sp"),
    pytest.param(["parallel.tensor=2"], marks=pytest.mark.slow, id="tp2"),
    # DP2 x PP2: ZeRO-2 shards the grads; ZeRO-3 also the params (moved as the flat shards'
    # rectangles of the main weights)
    pytest.param(["parallel.zero=2"], marks=pytest.mark.slow, id="dp2-zero2"),
    pytest.param(["parallel.zero=3"], marks=pytest.mark.slow, id="dp2-zero3"),
    pytest.param(["parallel.zero=3", "parallel.zero3_reshard_after_forward=false"],
                 marks=pytest.mark.slow, id="dp2-zero3-keep"),
])
def test_relayout_at_4_ranks_is_bitwise(tiny_corpus, tmp_path, extra):
    """At 4 ranks, [2,2] -> [1,3] after step 3 of 6 equals the uninterrupted [2,2] run bitwise
    (that [1,3] itself equals [2,2] is the first test's check, at 2 ranks)."""
    base = TINY + tiny_corpus + ["data.split=100,0,0", *extra]
    even = _run(tmp_path, "even", base + ["parallel.pipeline_layout=2,2"], world=4)
    _check_moved(tmp_path, base, even, 4)


def _cfg(*extra):
    return load_config(None, ["model.num_layers=4", "parallel.pipeline=2", *extra])


@pytest.mark.parametrize("layout, rule", [([1, 2], "sum to model.num_layers=4"),
                                          ([1, 1, 2], "needs parallel.pipeline*virtual_pipeline = 2")])
def test_a_layout_that_does_not_fit_is_refused(layout, rule):
    with pytest.raises(RelayoutRefused, match=r"re-layout to .* refused: .*" + rule.replace("*", r"\*")):
        check_request(_cfg(), layout)
    check_request(_cfg(), [1, 3])  # fits: no error


def test_a_refused_default_split_names_the_split_it_means():
    with pytest.raises(RelayoutRefused, match=r"re-layout to pipeline_layout=None \(the even split of "
                       r"model.num_layers=4 over parallel.pipeline\*virtual_pipeline = 3 stages\) refused: "
                       r"model.num_layers=4 is not divisible"):
        check_request(_cfg("parallel.pipeline=3"), None)
    check_request(_cfg(), None)  # [2, 2] fits


@pytest.mark.parametrize("degree", [0, -2])
def test_a_pipeline_degree_below_one_is_refused_in_one_line(degree, tmp_path, capsys):
    """``paratron resize --pipeline 0`` ended in a ZeroDivisionError traceback (the even split's
    modulo), and a callback's ``request_relayout(pipeline=0)`` takes the same check."""
    cfg = _cfg()
    cfg.parallel.pipeline = degree
    with pytest.raises(RelayoutRefused, match=rf"parallel.pipeline={degree} and parallel.virtual_pipeline=1 must be >= 1"):
        check_request(cfg, None)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["resize", str(tmp_path), "--pipeline", str(degree)])
    assert exit_.value.code == 2 and "--pipeline: " in capsys.readouterr().err


def test_request_file_is_taken_once_by_rank_0(tmp_path):
    write_request(tmp_path, [1, 3])
    assert take_request_file(tmp_path, 1) is None
    assert take_request_file(tmp_path, 0) == {"layout": [1, 3], "pipeline": None}
    assert take_request_file(tmp_path, 0) is None


def test_resize_command_checks_then_drops_the_request(tmp_path, capsys):
    from paratron.cli import main
    from paratron.launch.runlock import RunLock
    from paratron.config import to_toml

    (tmp_path / "config.toml").write_text(to_toml(_cfg()), encoding="utf-8")
    assert main(["resize", str(tmp_path), "--layout", "1,3"]) == 2
    assert "train.elastic_relayout=false" in capsys.readouterr().out
    (tmp_path / "config.toml").write_text(to_toml(_cfg("train.elastic_relayout=true")), encoding="utf-8")
    assert main(["resize", str(tmp_path), "--layout", "1,2"]) == 2
    assert "sum to model.num_layers=4" in capsys.readouterr().out
    assert main(["resize", str(tmp_path), "--layout", "-1,5"]) == 2  # the rule, not argparse's "expected one argument"
    assert "must be non-negative" in capsys.readouterr().out
    assert main(["resize", str(tmp_path), "--layout", "1,3", "--pipeline", "4"]) == 2
    assert "needs parallel.pipeline*virtual_pipeline = 4" in capsys.readouterr().out
    assert not (tmp_path / "relayout_request.json").exists()
    assert main(["resize", str(tmp_path), "--layout", "1,3"]) == 2  # no job holds the run directory
    assert "no job is running" in capsys.readouterr().out and not (tmp_path / "relayout_request.json").exists()
    with RunLock(tmp_path):
        assert main(["resize", str(tmp_path), "--layout", "1,3", "--wait", "0"]) == 0
        capsys.readouterr()
        # A second request while the first waits used to replace it: its sender then waited for
        # an answer that never came, and reported it "still queued".
        assert main(["resize", str(tmp_path), "--layout", "3,1", "--wait", "0"]) == 2
        assert "another re-layout request is waiting" in capsys.readouterr().out
    taken = take_request_file(tmp_path, 0)
    assert taken.pop("id") and taken == {"layout": [1, 3], "pipeline": None}


@pytest.mark.parametrize("outcome, code", [("applied", 0), ("refused", 1), (None, 3)])
def test_resize_waits_for_the_jobs_answer(tmp_path, capsys, outcome, code):
    """``paratron resize`` used to exit 0 once the request was dropped, even when the job then
    refused it (a grow with no free spare): it now waits for rank 0's answer to its request's
    id and exits 0 (applied), 1 (refused) or 3 (no answer in ``--wait`` seconds)."""
    from paratron.cli import main
    from paratron.config import to_toml
    from paratron.launch.runlock import RunLock

    (tmp_path / "config.toml").write_text(to_toml(_cfg("train.elastic_relayout=true")), encoding="utf-8")

    def job():  # rank 0 of a job: take the request at a step boundary, answer it
        for _ in range(100):
            req = take_request_file(tmp_path, 0)
            if req is not None:
                write_answer(tmp_path, {"id": "another"}, "applied", "an older request's answer")
                time.sleep(0.3)
                return write_answer(tmp_path, req, outcome, "no free spare") if outcome else None
            time.sleep(0.05)

    answering = threading.Thread(target=job)
    with RunLock(tmp_path):
        answering.start()
        assert main(["resize", str(tmp_path), "--layout", "1,3", "--wait", "2"]) == code
    answering.join()
    out = capsys.readouterr().out
    assert (f"{outcome} by the job: no free spare" if outcome else "no answer from the job within 2 s") in out, out


def test_a_new_job_removes_a_request_left_for_an_ended_one(tmp_path, capsys):
    from paratron.launch.command import run_locks

    write_request(tmp_path, [1, 3])
    with run_locks(tmp_path, _cfg(f"checkpoint.save={tmp_path / 'ck'}"), take=True) as refused:
        assert not refused
        assert take_request_file(tmp_path, 0) is None
    assert "left from an earlier job" in capsys.readouterr().err
