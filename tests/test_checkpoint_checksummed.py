"""Payload checksums computed while writing, verified block by block on load: a rank reads (and
verifies) only the saved chunks it needs, each byte once; a changed byte is still refused."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import google_crc32c
import pytest
import torch
import xxhash

from paratron.checkpoint import integrity
from paratron.checkpoint.finite import all_finite
from paratron.checkpoint.io import MANIFEST, load_model_full, save_model_full
from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.manager import CheckpointManager
from paratron.checkpoint.safety import METADATA_FILE, read_metadata_safely
from paratron.config import CheckpointConfig, Config
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import ShardSpec, mark
from paratron.local_ranks import run_ranks

ROWS, COLS, TENSORS = 256, 512, 4  # 512 KiB fp32 per tensor, 2 MiB in all


def _sharded(rank: int, world: int, seed: int) -> torch.nn.Module:
    """``TENSORS`` params ``[ROWS, COLS]`` split by rows over ``world`` ranks (this rank's block)."""
    m = torch.nn.Module()
    n = ROWS // world
    for i in range(TENSORS):
        full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed + i))
        p = torch.nn.Parameter(full[rank * n:(rank + 1) * n].clone(), requires_grad=False)
        mark(p, f"w{i}", ShardSpec((ROWS, COLS), (rank * n, 0), (n, COLS)), partition_dim=0)
        m.register_parameter(f"w{i}", p)
    return m


def _rchar() -> int:
    """Bytes this process has read through read-family system calls (page-cache hits included)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _save_then_count_load_bytes(root: str):
    ctx = ParallelContext.build()
    m = _sharded(ctx.rank, ctx.world_size, seed=1)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    cfg = Config()
    cfg.checkpoint.save = root
    mgr = CheckpointManager(cfg.checkpoint, ctx, cfg)
    mgr.save(1, [m], None, None, {})
    mgr.wait()
    loader = CheckpointManager(CheckpointConfig(load=root, load_optimizer=False), ctx, cfg)
    loader.load([m], None, None)  # a first load imports what loading needs (module files are reads too)
    for p in m.parameters():
        p.data.zero_()
    ctx.world.barrier()
    before = _rchar()
    loader.load([m], None, None)
    read = _rchar() - before
    same = all(torch.equal(v, m.state_dict()[k]) for k, v in want.items())
    share = sum(p.numel() * p.element_size() for p in m.parameters())
    return read, share, same


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="counts reads with /proc/self/io (Linux)")
def test_each_rank_reads_about_its_share_once(tmp_path):
    """2 ranks, state split by rows: each rank's load reads its own payload once (verification
    included) plus the small shared files, not its payload twice (a whole-file check, then DCP's
    read) nor the other rank's."""
    for r, (read, share, same) in enumerate(run_ranks(_save_then_count_load_bytes, 2, str(tmp_path / "ck"),
                                                       timeout=240)):
        assert same, f"rank {r} loaded other values"
        assert share <= read <= 1.15 * share + 64 * 1024, (r, read, share)


def test_block_reader_reads_in_pieces_and_catches_a_flipped_byte(tmp_path, monkeypatch):
    """The reader of resharded loads (DCP's ``torch.load`` through verified ranges) reads and
    checksums each block ``READ_SCAN`` bytes at a time: blocks of several pieces, the last one
    short, read back bitwise at any offset; a flipped byte inside a later piece is refused."""
    from paratron.checkpoint.checksummed import BlockReader

    monkeypatch.setattr(integrity, "BLOCK", 4096)
    monkeypatch.setattr(integrity, "READ_SCAN", 1000)  # 4 pieces a block, the last 96 bytes
    save_model_full(tmp_path / "ck", Config(), {"a": torch.randn(3000, generator=torch.Generator().manual_seed(1))})
    manifest = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    algorithm = integrity.manifest_algorithm(manifest, tmp_path / "ck" / MANIFEST)
    payload = max((tmp_path / "ck").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data, entry = payload.read_bytes(), manifest[integrity.CHECKSUMS][payload.name]
    reader = BlockReader(payload, entry, 0, algorithm)
    for start, n in ((0, len(data)), (4090, 5000), (4096, 4096), (7000, 50)):
        out = bytearray(n)
        reader.read_into(start, memoryview(out))
        assert bytes(out) == data[start:start + n], (start, n)
    reader.close()
    payload.write_bytes(data[:6200] + bytes([data[6200] ^ 1]) + data[6201:])  # block 1, its third piece
    reader = BlockReader(payload, entry, 0, algorithm)
    with pytest.raises(CheckpointError, match=r"checksum mismatch in bytes 4,096-8,192 \(read by rank 0\)"):
        reader.read_into(4096, memoryview(bytearray(4096)))
    reader.close()


def test_block_checksums_written_equal_the_files_and_catch_a_flipped_byte(tmp_path, monkeypatch):
    """With small blocks (many per saved chunk, chunks not aligned to them), the checksums the
    writer computed while writing equal those of the files read back; a load is bitwise; one
    flipped byte anywhere in a payload is refused, naming the file and the byte range."""
    monkeypatch.setattr(integrity, "BLOCK", 4096)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(1000, 7, generator=g), "b": torch.randn(333, generator=g).bfloat16(),
               "c": torch.arange(5000, dtype=torch.int64)}
    save_model_full(tmp_path / "ck", Config(), tensors)
    manifest = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    assert manifest[integrity.ALGORITHM_FIELD] == "xxh3_64"
    sums = manifest[integrity.CHECKSUMS]
    payloads = sorted((tmp_path / "ck").glob("*.distcp"))
    for payload in payloads:
        assert sums[payload.name] == integrity.file_checksum(payload, block=4096)
        data = payload.read_bytes()  # the blocks' XXH3-64 by the library itself, and their hash list
        blocks = [xxhash.xxh3_64_intdigest(data[i:i + 4096]) for i in range(0, len(data), 4096)]
        assert sums[payload.name][3] == "".join(f"{v:016x}" for v in blocks)
        assert sums[payload.name][0] == xxhash.xxh3_64_hexdigest(b"".join(v.to_bytes(8, "little") for v in blocks))
    assert sum(len(integrity.entry_blocks(sums[p.name])[1]) for p in payloads) > 10
    storage = read_metadata_safely(tmp_path / "ck" / METADATA_FILE).storage_data
    assert sorted(i.fqn for i in storage) == [f"model/{k}" for k in sorted(tensors)]  # sums not stored
    _, back = load_model_full(tmp_path / "ck")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    for payload in payloads:
        data = payload.read_bytes()
        for at in (0, 5000, len(data) // 2, len(data) - 1):
            payload.write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:])
            with pytest.raises(CheckpointError, match=rf"{payload.name}: checksum mismatch in bytes [\d,]+-[\d,]+ "
                                                      r"\(read by rank 0\)"):
                load_model_full(tmp_path / "ck")
        payload.write_bytes(data)
    _, back = load_model_full(tmp_path / "ck")


def _as_crc_manifest(directory: Path, blocks: bool, algorithm: str = "crc32") -> None:
    """Rewrite a checkpoint's manifest as older paratron wrote it: CRC-32C entries (before
    XXH3-64), or before that no ``checksum`` field and zlib CRC-32 entries, with block checksums
    (``blocks``) or only ``[crc, size]``."""
    man = json.loads((directory / MANIFEST).read_text())
    if algorithm == "crc32":
        del man[integrity.ALGORITHM_FIELD]
    else:
        man[integrity.ALGORITHM_FIELD] = algorithm
    sums = integrity.checksum_files(directory, man[integrity.CHECKSUMS], integrity.ALGORITHMS[algorithm])
    man[integrity.CHECKSUMS] = sums if blocks else {k: v[:2] for k, v in sums.items()}
    (directory / MANIFEST).write_bytes(integrity.seal_manifest(man))


@pytest.mark.parametrize("algorithm, blocks", [("crc32", True), ("crc32", False), ("crc32c", True), ("crc32c", False)],
                         ids=["block-crc32", "whole-file-crc32", "block-crc32c", "whole-file-crc32c"])
def test_a_checkpoint_with_an_older_crc_manifest_still_loads_and_is_verified(tmp_path, monkeypatch, algorithm, blocks):
    """The older manifest formats (zlib CRC-32 without a ``checksum`` field, then CRC-32C; each
    with and without block checksums, the latter verified whole before it is read) still load,
    and a flipped byte is still refused."""
    monkeypatch.setattr(integrity, "BLOCK", 4096)
    tensors = {"a": torch.randn(300, 5, generator=torch.Generator().manual_seed(1))}
    save_model_full(tmp_path / "ck", Config(), tensors)
    _as_crc_manifest(tmp_path / "ck", blocks, algorithm)
    (payload,) = (tmp_path / "ck").glob("*.distcp")
    data = payload.read_bytes()
    reference = {"crc32": zlib.crc32, "crc32c": google_crc32c.value}[algorithm]
    assert json.loads((tmp_path / "ck" / MANIFEST).read_text())[integrity.CHECKSUMS][payload.name][0] == \
        f"{reference(data):08x}"
    _, back = load_model_full(tmp_path / "ck")
    assert torch.equal(back["a"], tensors["a"])
    payload.write_bytes(data[:-7] + bytes([data[-7] ^ 1]) + data[-6:])
    message = r"checksum mismatch in bytes [\d,]+-[\d,]+" if blocks else f"checksum mismatch: {algorithm} "
    with pytest.raises(CheckpointError, match=rf"{payload.name}: {message}"):
        load_model_full(tmp_path / "ck")


def test_a_manifest_naming_an_unknown_checksum_algorithm_is_refused(tmp_path):
    save_model_full(tmp_path / "ck", Config(), {"a": torch.ones(3)})
    man = json.loads((tmp_path / "ck" / MANIFEST).read_text())
    man[integrity.ALGORITHM_FIELD] = "sha1"
    (tmp_path / "ck" / MANIFEST).write_bytes(integrity.seal_manifest(man))
    with pytest.raises(CheckpointError, match=r"paratron.json: checksum algorithm 'sha1' is unknown; .*crc32c"):
        load_model_full(tmp_path / "ck")


def test_all_finite_is_exact_when_a_sum_overflows():
    assert all_finite(torch.full((100,), 3e38))  # the float32 sum overflows; the values are finite
    assert all_finite(torch.full((100,), 60000.0, dtype=torch.float16))
    assert all_finite(torch.arange(10))
    for bad in (float("inf"), float("-inf"), float("nan")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            t = torch.ones(1000, dtype=dtype)
            t[617] = bad
            assert not all_finite(t), (bad, dtype)
    t = torch.full((100,), 3e38)
    t[3] = float("inf")
    assert not all_finite(t)


def test_a_load_reads_payload_bytes_straight_into_the_tensors(tmp_path, monkeypatch):
    """The load fills each tensor from the file without ``torch.load`` of its chunk (that makes a
    fresh tensor, then a copy): only each distinct chunk layout's zip directory is parsed (onto
    the meta device), once per dtype and shape; the values come back bitwise."""
    monkeypatch.setattr(integrity, "BLOCK", 4096)  # many blocks: the reader threads share them
    g = torch.Generator().manual_seed(3)
    tensors = {**{f"w{i}": torch.randn(64, 32, generator=g) for i in range(6)},
               "b0": torch.randn(7, generator=g).bfloat16(), "b1": torch.randn(7, generator=g).bfloat16(),
               "n": torch.arange(15, dtype=torch.int64).reshape(5, 3)}
    save_model_full(tmp_path / "ck", Config(), tensors)
    real_load, where = torch.load, []

    def counting_load(*args, **kwargs):
        where.append(str(kwargs.get("map_location")))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    _, back = load_model_full(tmp_path / "ck")
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())
    assert sorted(where) == ["meta"] * 3, where


def _second_save_spoiled_on_rank_1(root: str, how: str):
    """Save step 1, then step 2 with rank 1 spoiled by ``how``: "nan" (a NaN in its block of
    ``w2``), "plan" or "write" (an OSError in that phase); the second save's error on this rank
    (or None), what the root holds, and ``latest``."""
    from paratron.checkpoint.checksummed import ChecksummingWriter
    from paratron.checkpoint.dcp_planners import ChunkSavePlanner

    ctx = ParallelContext.build()
    m = _sharded(ctx.rank, ctx.world_size, seed=3)
    cfg = Config()
    cfg.checkpoint.save = root
    mgr = CheckpointManager(cfg.checkpoint, ctx, cfg)
    mgr.save(1, [m], None, None, {})
    mgr.wait()
    if ctx.rank == 1:
        def fail(*args, **kwargs):
            raise OSError(f"injected {how} failure")
        if how == "nan":
            with torch.no_grad():
                m.w2[5, 7] = float("nan")
        elif how == "plan":
            ChunkSavePlanner.create_local_plan = fail
        else:
            ChecksummingWriter.write_data = fail
    try:
        mgr.save(2, [m], None, None, {})
        error = None
    except CheckpointError as e:
        error = str(e)
    mgr.wait()
    ctx.world.barrier()
    return error, sorted(p.name for p in Path(root).iterdir()), (Path(root) / "latest").read_text().strip()


def test_a_nan_on_another_rank_is_refused_on_every_rank_and_nothing_is_committed(tmp_path):
    """The inf/NaN scan runs while the payloads are fsynced and travels with DCP's write results:
    a NaN on rank 1 fails the save on both ranks with the same message naming rank 1 and the
    tensor, and leaves neither a step_2 nor a temporary directory; ``latest`` stays on step 1."""
    out = run_ranks(_second_save_spoiled_on_rank_1, 2, str(tmp_path / "ck"), "nan", timeout=240)
    for error, names, latest in out:
        assert error is not None and "refusing to save step 2: model/w2 holds an inf or NaN on rank 1" in error, error
        assert names == ["latest", "step_1"], names
        assert latest == "step_1"


@pytest.mark.parametrize("phase", ["plan", "write"])
def test_a_rank_failing_to_plan_or_write_fails_the_save_on_every_rank(tmp_path, phase):
    """The save's collective rounds (``dcp_save.collective_save``: one all-gather of the plans,
    the results gathered, one broadcast of the outcome): a failure on rank 1 in either round
    reaches every rank as the same error naming rank 1, nothing hangs, and nothing is committed."""
    out = run_ranks(_second_save_spoiled_on_rank_1, 2, str(tmp_path / "ck"), phase, timeout=240)
    for error, names, latest in out:
        assert error is not None and f"on rank 1: OSError: injected {phase} failure" in error, error
        assert names == ["latest", "step_1"], names
        assert latest == "step_1"
