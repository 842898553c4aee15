"""Checkpoint and disk safety: every file checksummed at save time and verified on load, stale
temporaries of dead writers removed, a read-only or full save directory refused before step 1,
and a save that runs out of space reported as such, after which the next run resumes cleanly."""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from paratron import cli
from paratron.checkpoint import storage
from paratron.checkpoint.io import LATEST, load_model_full, verify_directory
from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.manager import CheckpointManager
from paratron.local_ranks import run_ranks
from paratron.models.gpt import build_model_chunks
from paratron.parallel.context import ParallelContext
from test_checkpoint_reshard import tiny_config

ROOT = Path(__file__).resolve().parents[1]
FIELD_NOTES = ROOT / "tests" / "fixtures" / "field_notes.jsonl"


def _flip(path: Path, at: int | None = None) -> bytes:
    data = path.read_bytes()
    i = len(data) // 2 if at is None else at
    path.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    return data


def _save_one(root: Path):
    cfg = tiny_config()
    cfg.checkpoint.save = str(root)
    chunks = build_model_chunks(cfg.model, ParallelContext.single(), seed=1)
    mgr = CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg)
    mgr.save(1, chunks, None, None, {"iteration": 1})
    mgr.wait()
    cfg.checkpoint.save, cfg.checkpoint.load = None, str(root)
    return cfg, chunks


def test_one_changed_byte_in_any_checkpoint_file_is_refused_naming_it(tmp_path):
    cfg, chunks = _save_one(tmp_path / "ck")
    step = tmp_path / "ck" / "step_1"
    names = sorted(p.name for p in step.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "config.toml", "paratron.json", "rank_00000.json"]
    for name in names:
        for at in (None, 0):  # the middle and the first byte of every file
            original = _flip(step / name, at)
            with pytest.raises(CheckpointError) as e:
                CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg).load(chunks, None, None)
            assert name in str(e.value) and "rank 0" in str(e.value), (name, at, str(e.value))
            (step / name).write_bytes(original)
    assert CheckpointManager(cfg.checkpoint, ParallelContext.single(), cfg).load(chunks, None, None) == {"iteration": 1}
    payload = step / "__0_0.distcp"
    payload.write_bytes(payload.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: truncated: [\d,]+ bytes, [\d,]+ were written"):
        load_model_full(tmp_path / "ck")
    payload.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: missing \(read by rank 0\)"):
        load_model_full(tmp_path / "ck")


def _corrupt_shard_then_load(root: str):
    ctx = ParallelContext.build(tp=2)
    cfg = tiny_config()
    cfg.checkpoint.save = root
    chunks = build_model_chunks(cfg.model, ctx, seed=1)
    mgr = CheckpointManager(cfg.checkpoint, ctx, cfg)
    mgr.save(1, chunks, None, None, {})
    mgr.wait()
    ctx.world.barrier()
    if ctx.rank == 0:
        _flip(Path(root) / "step_1" / "__1_0.distcp")
    ctx.world.barrier()
    cfg.checkpoint.save, cfg.checkpoint.load = None, root
    try:
        CheckpointManager(cfg.checkpoint, ctx, cfg).load(chunks, None, None)
        return "loaded"
    except CheckpointError as e:
        return str(e)


def test_a_corrupt_shard_names_the_file_and_the_rank_that_read_it(tmp_path):
    outcomes = run_ranks(_corrupt_shard_then_load, 2, str(tmp_path / "ck"), timeout=240)
    assert "__1_0.distcp: checksum mismatch" in outcomes[1] and "read by rank 1" in outcomes[1]
    assert outcomes[0] == "loaded" or ("__1_0.distcp" in outcomes[0] and "read by rank 0" in outcomes[0])


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    proc = mp.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join()
    dead, live = proc.pid, os.getppid()
    root = tmp_path / "ck"
    for name in (f"tmp.step_4.{dead}", f"step_2.{dead}", f"tmp.step_6.{live}", f"step_3.{dead}", "step_1"):
        (root / name).mkdir(parents=True)
    (root / LATEST).write_text(f"step_3.{dead}\n")  # a crash while replacing step 3 left latest here
    removed = storage.remove_stale_temporaries(root)
    assert sorted(p.name for p in removed) == [f"step_2.{dead}", f"tmp.step_4.{dead}"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", f"step_3.{dead}", f"tmp.step_6.{live}"]


def _train_argv(tmp_path: Path) -> list[str]:
    argv = ["train", "--data", str(FIELD_NOTES), "--run-dir", str(tmp_path / "run"), "--train-iters", "2"]
    for o in ["model.hidden_size=32", "model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=2",
              "train.global_batch_size=2", f"data.cache_dir={tmp_path / 'cache'}", "logging.tensorboard=false"]:
        argv += ["--set", o]
    return argv


def test_read_only_save_dir_is_refused_before_step_1(tmp_path, monkeypatch, capsys):
    real_open = os.open

    def read_only(path, *args, **kwargs):  # as a non-root user on a read-only directory
        if os.path.basename(path).startswith(".paratron-write-probe"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert cli.main(_train_argv(tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"checkpoint directory {tmp_path / 'run' / 'checkpoints'} is not writable: Permission denied" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_nearly_full_disk_is_refused_before_step_1(tmp_path, monkeypatch, capsys):
    real = os.statvfs

    def nearly_full(path):
        st = real(path)
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 10, 10, st.f_files, st.f_ffree,
                                  st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(os, "statvfs", nearly_full)
    assert cli.main(_train_argv(tmp_path)) == 2
    err = capsys.readouterr().err
    assert (f"no space left on device for a checkpoint in {tmp_path / 'run' / 'checkpoints'}: it needs about "
            in err) and "bytes are free" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


RUN = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
       "model.make_vocab_size_divisible_by=16", "train.micro_batch_size=2", "train.global_batch_size=4",
       "train.train_iters=4", "train.eval_interval=0", "train.deterministic=true", "checkpoint.interval=2",
       "logging.tensorboard=false", "logging.progress=false"]


def _run_with_full_disk_at(overrides: list[str], run_dir: str, fail_at_save: int):
    """One rank of a run whose ``fail_at_save``-th save hits a full disk mid-write (0: never)."""
    import paratron.checkpoint.io as io
    from paratron.rules import load_config
    from paratron.launch.runner import run_training

    class FillsUp(io.ChecksummingWriter):
        calls = 0

        def write_data(self, plan, planner):
            FillsUp.calls += 1
            if FillsUp.calls == fail_at_save:
                Path(self.path, "__0_0.distcp").write_bytes(b"partial")  # what a full disk leaves
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write_data(plan, planner)

    io.ChecksummingWriter = FillsUp  # this forked rank only
    try:
        return run_training(load_config(None, overrides), run_dir)
    except CheckpointError as e:
        return str(e)


def test_save_on_a_full_disk_says_so_and_the_next_run_resumes(tiny_corpus, tmp_path):
    root = tmp_path / "ck"
    first = RUN + tiny_corpus + [f"checkpoint.save={root}"]
    (message,) = run_ranks(_run_with_full_disk_at, 1, first, str(tmp_path / "a"), 2, timeout=300)
    assert message.startswith(f"no space left on device for a checkpoint in {root}: it needs about "), message
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_2"]  # no partial directory left
    assert (root / LATEST).read_text().strip() == "step_2"
    second = first + [f"checkpoint.load={root}"]
    assert run_ranks(_run_with_full_disk_at, 1, second, str(tmp_path / "b"), 0, timeout=300) == [0]
    assert (root / LATEST).read_text().strip() == "step_4"
    records = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [3, 4]  # resumed after step 2
    manifest = verify_directory(root / "step_4")
    _, tensors = load_model_full(root)
    assert all(torch.isfinite(t).all() for t in tensors.values())
    # The pre-launch estimate of a checkpoint's size counts the tensors that were written.
    from paratron.checkpoint.io import saved_tensors
    from paratron.config import from_dict
    from paratron.training.preflight import estimated_checkpoint_bytes

    tensors = sum(md.size.numel() * md.properties.dtype.itemsize for md in saved_tensors(root / "step_4").values())
    assert estimated_checkpoint_bytes(from_dict(manifest["config"], "x"), None) == tensors


@pytest.mark.parametrize("name", ["crc32", "crc32c"])
def test_blockwise_crc_equals_the_crc_of_the_whole_file(tmp_path, monkeypatch, name):
    """Per-block CRCs combined (files read by threads, and a stream fed in odd pieces) equal the
    reference library's CRC of the whole content, for both algorithms (old and new manifests)."""
    import zlib

    import google_crc32c

    from paratron.checkpoint import integrity

    reference = {"crc32": zlib.crc32, "crc32c": google_crc32c.value}[name]
    algorithm = integrity.ALGORITHMS[name]
    monkeypatch.setattr(integrity, "BLOCK", 1000)  # many blocks, a short last one
    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 999, 1000, 1001, 12_345):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
        (tmp_path / "f").write_bytes(data)
        assert integrity.file_crc32(tmp_path / "f", threads=3, algorithm=algorithm) == (f"{reference(data):08x}", n)
        stream = integrity.BlockCrc(1000, algorithm)
        for at in range(0, n, 377):
            stream.update(memoryview(bytearray(data[at:at + 377])))  # writable buffers, as torch hands them
        assert stream.entry() == integrity.file_checksum(tmp_path / "f", algorithm=algorithm)
    polynomial = {"crc32": integrity.CRC32_POLYNOMIAL, "crc32c": integrity.CRC32C_POLYNOMIAL}[name]
    assert integrity.crc32_combine(reference(b"abc"), reference(b"defg"), 4, polynomial) == reference(b"abcdefg")


def test_xxh3_entries_hold_the_blocks_values_and_their_hash_list(tmp_path, monkeypatch):
    """XXH3-64 (new saves): each block's value is the library's XXH3-64 of those bytes, the file's
    the XXH3-64 of the blocks' values in order; files read by threads and a stream fed in odd
    pieces give the same entry, and a whole-file check recomputes it at the entry's block size."""
    import xxhash

    from paratron.checkpoint import integrity

    algorithm = integrity.ALGORITHMS["xxh3_64"]
    assert integrity.CURRENT is algorithm
    g = torch.Generator().manual_seed(4)
    for n in (0, 1, 999, 1000, 1001, 12_345):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()
        (tmp_path / "f").write_bytes(data)
        values = [xxhash.xxh3_64_intdigest(data[i:i + 1000]) for i in range(0, n, 1000)]
        whole = xxhash.xxh3_64_hexdigest(b"".join(v.to_bytes(8, "little") for v in values))
        want = [whole, n, 1000, "".join(f"{v:016x}" for v in values)]
        assert integrity.file_checksum(tmp_path / "f", threads=3, algorithm=algorithm, block=1000) == want
        stream = integrity.BlockCrc(1000, algorithm)
        for at in range(0, n, 377):
            stream.update(memoryview(bytearray(data[at:at + 377])))
        assert stream.entry() == want
        assert integrity.entry_blocks(want, algorithm) == (1000, values)
        integrity.verify_files(tmp_path, {"f": want}, ["f"], 0, algorithm)  # BLOCK differs: the entry's is used
        if n:
            (tmp_path / "f").write_bytes(data[:-1] + bytes([data[-1] ^ 4]))
            with pytest.raises(CheckpointError, match=r"f: checksum mismatch: xxh3_64 "):
                integrity.verify_files(tmp_path, {"f": want}, ["f"], 0, algorithm)
