"""Checkpoint problems that plain files show are refused before launch, naming the file and the
steps there are; the ranks agree on a load before any of them reports a resume; a failed save is
reported as the save of its iteration."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from paratron import cli
from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.manager import CheckpointManager
from paratron.data.indexed import IndexedDatasetWriter
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks
from paratron.launch.failures import collect, summarize
from paratron.launch.rankproc import write_error_record
from test_checkpoint_integrity import _flip
from test_checkpoint_reshard import tiny_config

RUN = ["model.hidden_size=32", "model.num_layers=1", "model.num_attention_heads=4", "model.seq_length=32",
       "train.micro_batch_size=1", "train.global_batch_size=2", "train.eval_interval=0", "train.sample_tokens=0",
       "checkpoint.interval=2", "logging.tensorboard=false", "logging.progress=false"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[str]]:
    """A run's checkpoints step_2 and step_4 (``latest``: step_4), and the arguments of that run."""
    d = tmp_path_factory.mktemp("ckpt_preflight")
    with IndexedDatasetWriter(d / "data", np.int32) as w:
        for doc in range(100):
            w.add_document(100 * doc + np.arange(200))
    args = ["--data-path", str(d / "data")]
    for o in RUN + [f"data.cache_dir={d / 'cache'}"]:
        args += ["--set", o]
    root = d / "ck"
    assert cli.main(["train", "--run-dir", str(d / "run"), "--train-iters", "4", *args,
                     "--set", f"checkpoint.save={root}"]) == 0
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_2", "step_4"]
    return root, args


@pytest.fixture
def launches(monkeypatch):
    """Every torchrun the launcher would start (none is: each returns 0 at once)."""
    import paratron.launch.launch as launch

    started = []
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd, *a, **k: started.append(cmd) or 0)
    return started


def _resume(saved, tmp_path, capsys, launches, *extra: str) -> str:
    """Resume from a copy of the checkpoints, broken by the caller first; returns stderr."""
    root, args = saved
    argv = ["train", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), "--train-iters", "6", *args,
            "--set", f"checkpoint.load={tmp_path / 'ck'}", "--set", f"checkpoint.save={tmp_path / 'out'}"]
    for o in extra:
        argv += ["--set", o]
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2 and launches == [], err  # refused before torchrun: no rank, no process group
    assert err.startswith("paratron train: config error: checkpoint.load="), err
    return err


@pytest.fixture
def ck(saved, tmp_path) -> Path:
    shutil.copytree(saved[0], tmp_path / "ck")
    return tmp_path / "ck"


def test_latest_naming_a_missing_step_is_refused_before_launch(saved, ck, tmp_path, capsys, launches):
    (ck / "latest").write_text("step_12\n")
    err = _resume(saved, tmp_path, capsys, launches)
    assert f"{ck / 'latest'} names step_12, which does not exist; checkpoints in {ck}: step_2, step_4" in err


def test_a_missing_load_step_lists_the_steps(saved, ck, tmp_path, capsys, launches):
    err = _resume(saved, tmp_path, capsys, launches, "checkpoint.load_step=12")
    assert f"no checkpoint for step 12 in {ck}; checkpoints in {ck}: step_2, step_4" in err


def test_a_checkpoint_of_another_model_is_refused_before_launch(saved, ck, tmp_path, capsys, launches):
    err = _resume(saved, tmp_path, capsys, launches, "model.hidden_size=64", "model.num_layers=2")
    assert f"{ck / 'step_4'} was saved for another model" in err
    assert "model.hidden_size: checkpoint 32, this run 64" in err and "model.num_layers: checkpoint 1, this run 2" in err
    assert f"checkpoints in {ck}: step_2 " in err


def test_a_missing_manifest_is_refused_naming_it(saved, ck, tmp_path, capsys, launches):
    (ck / "step_4" / "paratron.json").unlink()
    err = _resume(saved, tmp_path, capsys, launches)
    assert f"{ck / 'step_4'} has no paratron.json" in err and f"checkpoints in {ck}: step_2 " in err


def test_a_missing_metadata_file_is_refused_before_launch(saved, ck, tmp_path, capsys, launches):
    """A checkpoint without DCP's ``.metadata`` used to pass the check before launch and fail on
    every rank (exit 1); it is refused first (exit 2), naming the file."""
    (ck / "step_4" / ".metadata").unlink()
    err = _resume(saved, tmp_path, capsys, launches)
    assert f"{ck / 'step_4'} has no .metadata" in err and f"checkpoints in {ck}: step_2 " in err


@pytest.mark.parametrize("damage", ["flipped byte", "cut short"])
def test_a_corrupt_manifest_is_refused_naming_it(saved, ck, tmp_path, capsys, launches, damage):
    manifest = ck / "step_4" / "paratron.json"
    if damage == "flipped byte":
        _flip(manifest)
    else:
        manifest.write_bytes(manifest.read_bytes()[:-40])
    err = _resume(saved, tmp_path, capsys, launches)
    assert f"{manifest}" in err and ("checksum does not match" in err or "is not valid JSON" in err), err
    assert f"checkpoints in {ck}: step_2 " in err


def test_no_optimizer_state_is_refused_before_launch(saved, tmp_path, capsys, launches):
    """A weights-only checkpoint (as ``paratron convert hf-to-paratron`` writes) under
    ``checkpoint.load_optimizer=true`` (the default); no tensor is read before launch."""
    from paratron.checkpoint.io import save_model_full
    from paratron.rules import load_config

    cfg = load_config(None, RUN)
    cfg.model.vocab_size = 50257  # the tokenizer's, as the ranks record it
    save_model_full(tmp_path / "ck", cfg, {"output_layer.weight": torch.zeros(2, 2)})
    err = _resume(saved, tmp_path, capsys, launches)
    assert f"{tmp_path / 'ck'} holds no optimizer state" in err and "checkpoint.load_optimizer=false" in err
    assert f"no other checkpoint in {tmp_path / 'ck'}" in err  # the directory is the checkpoint itself


def _load_everywhere(root: str, corrupt: bool):
    """Save at tp=2, corrupt (or not) the file only rank 1 reads (its ``rank_00001.json``), then
    every rank loads through load_everywhere."""
    ctx = ParallelContext.build(tp=2)
    cfg = tiny_config()
    cfg.checkpoint.save = root
    chunks = build_model_chunks(cfg.model, ctx, seed=1)
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(1, chunks, None, None, {"iteration": 1})
    ctx.world.barrier()
    if ctx.rank == 0 and corrupt:
        _flip(Path(root) / "step_1" / "rank_00001.json")
    ctx.world.barrier()
    cfg.checkpoint.save, cfg.checkpoint.load = None, root
    try:
        return CheckpointManager(cfg.checkpoint, ctx, cfg).load_everywhere(chunks, None, None)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"


def test_no_rank_reports_a_load_that_another_refused(tmp_path):
    """Rank 0 reads only intact files; it must still stop, naming rank 1's error, instead of
    going on (and printing "resumed from")."""
    outcomes = run_ranks(_load_everywhere, 2, str(tmp_path / "ck"), True, timeout=240)
    assert outcomes[1].startswith("CheckpointError: ") and "rank_00001.json: checksum mismatch" in outcomes[1]
    assert outcomes[0].startswith("PeerCheckpointError: rank 1 could not load the checkpoint: CheckpointError: "
                                  ), outcomes[0]
    assert "rank_00001.json: checksum mismatch" in outcomes[0] and "read by rank 1" in outcomes[0]
    assert run_ranks(_load_everywhere, 2, str(tmp_path / "intact"), False, timeout=240) == [{"iteration": 1}] * 2


def test_resumed_from_is_printed_only_after_every_rank_loaded(capsys):
    """The trainer resumes through load_everywhere: a rank whose own part loaded, while another
    rank's did not, prints no "resumed from" line before it stops."""
    from types import SimpleNamespace

    from paratron.rules import load_config
    from paratron.training.trainer import Trainer

    class HalfLoaded:
        def load(self, *args):  # this rank's part
            return {"iteration": 12}

        def load_everywhere(self, *args):
            raise CheckpointError("rank 1 could not load the checkpoint: CheckpointError: ...")

    stub = SimpleNamespace(state=SimpleNamespace(), cfg=load_config(None, ["checkpoint.load=/nowhere"]),
                           ctx=ParallelContext.single(), ckpt=HalfLoaded(), chunks=None, optimizer=None,
                           scheduler=None)
    raised = None
    try:
        Trainer.resume(stub)
    except Exception as e:  # noqa: BLE001 - which one is asserted below, after the output
        raised = e
    assert "resumed from" not in capsys.readouterr().out
    assert isinstance(raised, CheckpointError), raised


def _failing_save(root: Path, asynchronous: bool) -> BaseException:
    """The save of iteration 4 fails on a full disk mid-write; the exception as the loop sees it."""
    import paratron.checkpoint.io as io

    cfg = tiny_config()
    cfg.checkpoint.save = str(root)
    chunks = build_model_chunks(cfg.model, ParallelContext.single(), seed=1)
    mgr = CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg)

    class FillsUp(io.ChecksummingWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device")

    real, io.ChecksummingWriter = io.ChecksummingWriter, FillsUp
    try:
        mgr.save(4, chunks, None, None, {"iteration": 4}, async_=asynchronous)
        mgr.wait()
    except CheckpointError as e:
        e.paratron_step = 5  # what the watchdog sets: the iteration after the last finished step
        return e
    finally:
        io.ChecksummingWriter = real
    raise AssertionError("the save did not fail")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_save_is_named_as_the_save_of_its_iteration(tmp_path, asynchronous):
    exc = _failing_save(tmp_path / "ck", asynchronous)
    assert exc.paratron_save == 4
    write_error_record(tmp_path / "logs", 0, exc)
    first = summarize(collect(tmp_path / "logs", {}, {}), tmp_path / "logs")[0]
    assert first.startswith("rank 0 failed first while saving the checkpoint of iteration 4: "), first
    assert "no space left on device" in first and "step 5" not in first


def test_a_corrupt_payload_alone_is_one_line_not_a_traceback(saved, ck, tmp_path, capsys):
    """A single process (no ``--nproc-per-node``) resuming from a checkpoint whose payload is
    damaged used to end in a full traceback; it now prints one line naming the error, exit 1.
    (The damage is found as the bytes are read, after launch: a launched job sums it up the same way.)"""
    payload = max((ck / "step_4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    _flip(payload)
    root, args = saved
    code = cli.main(["train", "--run-dir", str(tmp_path / "run"), "--train-iters", "6", *args,
                     "--set", f"checkpoint.load={ck}", "--set", f"checkpoint.save={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "paratron train: error: CheckpointError: " in err and "Traceback" not in err, err
