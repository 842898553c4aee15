"""CheckpointManager: atomic commit and rotation, crash during a save, async saves, RNG, config checks."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from paratron.checkpoint.io import LATEST, MANIFEST, load_model_full, verify_directory
from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.manager import CheckpointManager
from paratron.checkpoint.rng import derived_seed
from paratron.config import CheckpointConfig
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from paratron.parallel.random import MODEL_PARALLEL_RNG
from paratron.local_ranks import run_ranks
from test_checkpoint_reshard import tiny_config


def _model(cfg, ctx=None, seed=1):
    return build_model_chunks(cfg.model, ctx or ParallelContext.single(), seed=seed)


def _bump(chunks, value):
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.fill_(value)


def _saver(tmp_path, keep_last=3):
    cfg = tiny_config()
    cfg.checkpoint.save = str(tmp_path / "ck")
    cfg.checkpoint.keep_last = keep_last
    return cfg, CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg)


def test_rotation_keeps_last_k_and_latest_is_newest(tmp_path):
    cfg, mgr = _saver(tmp_path, keep_last=2)
    chunks = _model(cfg)
    for step in range(1, 6):
        _bump(chunks, float(step))
        mgr.save(step, chunks, None, None, {"iteration": step})
    mgr.wait()  # old checkpoints are deleted in the background
    root = tmp_path / "ck"
    assert sorted(os.listdir(root)) == ["latest", "step_4", "step_5"]
    assert (root / LATEST).read_text().strip() == "step_5"
    _, t = load_model_full(root)
    assert all(torch.all(v == 5.0) for v in t.values())


def test_pruning_leaves_a_later_save_of_this_job_being_written(tmp_path):
    """Rank 0 prunes in the background after a commit, while the other ranks may already write
    the next save's tmp dir: that one stays; a dead writer's leftovers go."""
    cfg, mgr = _saver(tmp_path)
    root = tmp_path / "ck"
    dead = mp.get_context("fork").Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    (root / f"tmp.step_3.{os.getpid()}").mkdir(parents=True)  # made after the manager's start-up sweep
    (root / f"tmp.step_9.{dead.pid}").mkdir()
    mgr.save(2, _model(cfg), None, None, {"iteration": 2})
    mgr.wait()
    assert sorted(os.listdir(root)) == ["latest", "step_2", f"tmp.step_3.{os.getpid()}"]


def test_resaving_a_step_replaces_it(tmp_path):
    cfg, mgr = _saver(tmp_path)
    chunks = _model(cfg)
    _bump(chunks, 1.0)
    mgr.save(3, chunks, None, None, {})
    _bump(chunks, 2.0)
    mgr.save(3, chunks, None, None, {})
    mgr.wait()
    root = tmp_path / "ck"
    assert sorted(os.listdir(root)) == ["latest", "step_3"]
    _, t = load_model_full(root)
    assert all(torch.all(v == 2.0) for v in t.values())


def _crashing_saver(root, marker):
    torch.set_num_threads(1)
    cfg = tiny_config()
    cfg.checkpoint.save = root
    mgr = CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg)
    chunks = _model(cfg)
    _bump(chunks, 2.0)
    mgr.save(2, chunks, None, None, {"iteration": 2})

    def pause(phase, path):
        if phase == "tensors_written":
            open(marker, "w").close()
            time.sleep(600)  # killed here, between the tensor files and the commit

    mgr.on_phase = pause
    _bump(chunks, 4.0)
    mgr.save(4, chunks, None, None, {"iteration": 4})


def test_kill_during_save_leaves_previous_latest_loadable(tmp_path):
    root, marker = str(tmp_path / "ck"), str(tmp_path / "paused")
    proc = mp.get_context("fork").Process(target=_crashing_saver, args=(root, marker))
    proc.start()
    deadline = time.monotonic() + 120
    while not os.path.exists(marker):
        assert proc.is_alive() and time.monotonic() < deadline, "the saver never reached the pause"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    names = sorted(os.listdir(root))
    assert names[:2] == ["latest", "step_2"] and names[2].startswith("tmp.step_4."), names
    with pytest.raises(CheckpointError, match="no paratron.json"):
        verify_directory(os.path.join(root, names[2]))
    # Resume from latest: step 2's weights and extra.
    cfg = tiny_config()
    cfg.checkpoint.load = root
    chunks = _model(cfg, seed=9)
    extra = CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg).load(chunks, None, None)
    assert extra == {"iteration": 2}
    assert all(torch.all(p.meta.shard.valid(p) == 2.0) for c in chunks for p in c.parameters())
    # The next successful save clears the leftover.
    cfg.checkpoint.save = root
    mgr = CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg)
    mgr.save(4, chunks, None, None, {})
    mgr.wait()
    assert sorted(os.listdir(root)) == ["latest", "step_2", "step_4"]


def test_async_save_writes_the_values_at_save_time(tmp_path):
    cfg, mgr = _saver(tmp_path)
    chunks = _model(cfg)
    _bump(chunks, 1.5)
    mgr.save(1, chunks, None, None, {"iteration": 1}, async_=True)
    _bump(chunks, -7.0)  # training goes on while the write runs
    mgr.wait()
    _, t = load_model_full(tmp_path / "ck")
    assert all(torch.all(v == 1.5) for v in t.values())
    assert mgr.last_stall_s <= mgr.last_write_s


def test_async_failure_surfaces_in_wait(tmp_path):
    cfg = tiny_config()
    (tmp_path / "file").write_text("not a directory")
    cfg.checkpoint.save = str(tmp_path / "file")
    mgr = CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg)
    mgr.save(1, _model(cfg), None, None, {}, async_=True)
    with pytest.raises(CheckpointError, match="asynchronous checkpoint save failed"):
        mgr.wait()


def test_other_model_config_is_refused_naming_fields(tmp_path):
    cfg, mgr = _saver(tmp_path)
    mgr.save(1, _model(cfg), None, None, {})
    other = tiny_config()
    other.model.hidden_size = 64
    other.model.normalization = "rmsnorm"
    other.checkpoint.load = str(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"model.hidden_size: checkpoint 32, this run 64.*"
                                              r"model.normalization"):
        CheckpointManager(other.checkpoint, ParallelContext.single(), other).load(_model(other), None, None)


def test_load_of_an_empty_directory_is_a_fresh_start(tmp_path):
    cfg = tiny_config()
    (tmp_path / "ck").mkdir()
    cfg.checkpoint.load = str(tmp_path / "ck")
    assert CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg).load(_model(cfg), None, None) is None


def _draws(chunks):
    tracker = chunks[0].rng_tracker
    with tracker.fork(MODEL_PARALLEL_RNG):
        mp_draw = torch.rand(4)
    return torch.rand(4), mp_draw


def _rng_round_trip(root):
    cfg = tiny_config()
    cfg.model.hidden_dropout = 0.1  # the model then owns an RNG tracker
    ctx = ParallelContext.build(tp=2)
    chunks = _model(cfg, ctx)
    chunks[0].rng_tracker.seed_default_stream()
    _draws(chunks)
    cfg.checkpoint.save = root
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(7, chunks, None, None, {})
    expected = _draws(chunks)
    _draws(chunks)
    cfg.checkpoint.load = root
    CheckpointManager(cfg.checkpoint, ctx, cfg).load(chunks, None, None)
    same_layout = _draws(chunks)
    # Another layout (dp2 instead of tp2): the streams are re-derived from (seed, step, coordinates).
    ctx_b = ParallelContext.build(tp=1)
    chunks_b = _model(cfg, ctx_b)
    CheckpointManager(CheckpointConfig(load=root), ctx_b, cfg).load(chunks_b, None, None)
    rederived = _draws(chunks_b)
    return expected, same_layout, rederived


def test_rng_restored_per_rank_or_rederived(tmp_path):
    res = run_ranks(_rng_round_trip, 2, str(tmp_path / "ck"), timeout=300)
    for rank, (expected, same, rederived) in enumerate(res):
        assert torch.equal(expected[0], same[0]) and torch.equal(expected[1], same[1]), rank
    assert torch.equal(res[0][0][0], res[1][0][0]), "the default stream agrees across TP ranks"
    assert not torch.equal(res[0][0][1], res[1][0][1]), "the model-parallel stream differs across TP ranks"
    seed = derived_seed(tiny_config().train.seed, 7)
    want = torch.Generator().manual_seed(seed)
    assert torch.equal(res[0][2][0], torch.rand(4, generator=want)), "re-derived default stream"
    assert torch.equal(res[0][2][0], res[1][2][0]), "dp replicas share the re-derived default stream"
    assert not torch.equal(res[0][2][0], res[0][0][0])


def test_manifest_records_everything(tmp_path):
    cfg, mgr = _saver(tmp_path)
    mgr.save(2, _model(cfg), None, None, {"consumed_train_samples": 32, "consumed_valid_samples": 8})
    m = verify_directory(tmp_path / "ck" / "step_2")
    assert m["step"] == 2 and m["extra"]["consumed_valid_samples"] == 8
    assert m["config"]["model"]["hidden_size"] == 32 and m["layout"]["world"] == 1
    assert (tmp_path / "ck" / "step_2" / "rank_00000.json").is_file()
    assert (tmp_path / "ck" / "step_2" / MANIFEST).is_file()


def test_load_step_picks_an_older_checkpoint(tmp_path):
    cfg, mgr = _saver(tmp_path)
    chunks = _model(cfg)
    for step in (1, 2):
        _bump(chunks, float(step))
        mgr.save(step, chunks, None, None, {"iteration": step})
    cfg.checkpoint.load, cfg.checkpoint.load_step = str(tmp_path / "ck"), 1
    fresh = _model(cfg, seed=5)
    assert CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg).load(fresh, None, None) == {"iteration": 1}
    assert all(torch.all(p.meta.shard.valid(p) == 1.0) for c in fresh for p in c.parameters())
    cfg.checkpoint.load_step = 7
    with pytest.raises(CheckpointError, match="no checkpoint for step 7"):
        CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg).load(fresh, None, None)


def test_bad_checkpoint_settings_are_named():
    cfg = tiny_config()
    with pytest.raises(CheckpointError, match=r"checkpoint.keep_last=-1 must be >= 0"):
        CheckpointManager(CheckpointConfig(keep_last=-1), ParallelContext.single(), cfg)
    with pytest.raises(CheckpointError, match=r"checkpoint.load_step=3 needs checkpoint.load"):
        CheckpointManager(CheckpointConfig(load_step=3), ParallelContext.single(), cfg)


def test_every_file_is_durable_before_the_manifest_and_latest(tmp_path, monkeypatch):
    """Every file of a checkpoint is fsynced before its manifest appears, and ``latest`` moves only
    after the manifest and the directory's rename are durable."""
    events = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def name(path):  # a temp file being fsynced by its final name: ".config.toml.tmp.123", ".metadata.tmp"
        base = os.path.basename(str(path))
        if base.endswith(".tmp"):
            return base[:-len(".tmp")]
        return base[1:base.index(".tmp.")] if ".tmp." in base and base.startswith(".") else base

    def fsync(fd):
        events.append(("fsync", name(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", name(b))), real_replace(a, b))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", name(b))), real_rename(a, b))[1])
    cfg, mgr = _saver(tmp_path)
    mgr.save(1, _model(cfg), None, None, {})
    mgr.wait()
    files = sorted(os.listdir(tmp_path / "ck" / "step_1"))
    assert {"__0_0.distcp", ".metadata", "config.toml", "rank_00000.json", MANIFEST} <= set(files)
    manifest_at = events.index(("replace", MANIFEST))
    synced_before = {n for kind, n in events[:manifest_at] if kind == "fsync"}
    assert set(files) - {MANIFEST} <= synced_before, events
    assert ("fsync", MANIFEST) in events[:manifest_at]
    latest_at = len(events) - 1 - events[::-1].index(("replace", LATEST))
    assert events.index(("rename", "step_1")) < latest_at and ("fsync", LATEST) in events[manifest_at:latest_at]
