"""A rank's payload file is written from per-layout zip templates, one ``writev`` per tensor, and
is still byte for byte what DCP's own writer (one ``torch.save`` per tensor) writes: DCP's reader
and ``torch.load`` read it, and its checksums still catch a changed byte anywhere, the template's
headers included."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from paratron.checkpoint import integrity, payload
from paratron.checkpoint.checksummed import FILES_PER_RANK
from paratron.checkpoint.dcp_planners import ChunkLoadPlanner, ChunkSavePlanner
from paratron.checkpoint.io import load_model_full, save_model_full, write_items
from paratron.checkpoint.items import CheckpointError, full_items
from paratron.checkpoint.payload import ZipTemplates, no_record_crc32
from paratron.checkpoint.safety import METADATA_FILE, read_metadata_safely
from paratron.config import Config


def _layouts(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of many layouts, two of each, so the second of each is written from its template:
    same shape with other strides, other dtypes, a 0-d and an empty tensor, a view of a larger
    storage (copied, as DCP does) and a storage offset."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(40, 30, generator=g)
    out = {}
    for k in range(2):
        out.update({
            f"rows{k}": torch.randn(30, 40, generator=g),
            f"cols{k}": torch.randn(40, 30, generator=g).t(),  # shape (30, 40) as rows, other strides
            f"half{k}": torch.randn(333, generator=g).bfloat16(),
            f"ints{k}": torch.arange(77 + 0, dtype=torch.int64) * (k + 1),
            f"flags{k}": torch.rand(13, generator=g) > 0.5,
            f"scalar{k}": torch.tensor(float(k) + 0.5),
            f"empty{k}": torch.zeros(0, 4),
            f"view{k}": base[k * 10:k * 10 + 10],
        })
    return out


def _torch_save(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    with no_record_crc32():
        torch.save(t, buf)
    return buf.getvalue()


def test_zip_templates_write_exactly_what_torch_save_writes():
    """For every layout, first (torch.save itself) and second time (from the template, other
    values): the pieces joined equal ``torch.save``'s bytes, and ``torch.load`` reads them back."""
    templates = ZipTemplates()
    for name, t in list(_layouts(0).items()) + list(_layouts(1).items()):
        t = t.detach().clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t.detach()
        got = b"".join(bytes(memoryview(p).cast("B")) for p in templates.pieces(t))
        assert got == _torch_save(t), name
        assert torch.equal(torch.load(io.BytesIO(got), weights_only=True), t), name
    grad = torch.randn(3, requires_grad=True)  # not a template's layout: torch.save's own bytes
    assert b"".join(bytes(p) for p in templates.pieces(grad)) == _torch_save(grad)


def _save(directory, tensors, writer=None) -> None:
    items = full_items(tensors)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if writer is None:
            write_items(directory, items, single_process=True)
        else:
            with no_record_crc32():
                dcp.save({}, storage_writer=writer, planner=ChunkSavePlanner(items), no_dist=True)


def test_a_payload_file_is_byte_for_byte_what_dcps_own_writer_writes(tmp_path, monkeypatch):
    """DCP's ``FileSystemWriter`` (one ``torch.save`` per tensor, as many files and threads) and
    paratron's writer give the same payload files, byte for byte, and the same offsets in
    ``.metadata``; DCP's own reader loads paratron's files bitwise."""
    tensors = _layouts(2)
    # torch's record-CRC switch does not reach DCP's writer threads: switched off for them too.
    monkeypatch.setattr(torch.serialization, "get_crc32_options", lambda: False)
    _save(tmp_path / "dcp", tensors, FileSystemWriter(str(tmp_path / "dcp"), single_file_per_rank=True,
                                                       thread_count=FILES_PER_RANK, sync_files=False))
    _save(tmp_path / "ours", tensors)
    names = sorted(p.name for p in (tmp_path / "ours").glob("*.distcp"))
    assert names == sorted(p.name for p in (tmp_path / "dcp").glob("*.distcp")) and len(names) == FILES_PER_RANK
    for name in names:
        ours, theirs = (tmp_path / "ours" / name).read_bytes(), (tmp_path / "dcp" / name).read_bytes()
        assert len(ours) == len(theirs) and ours == theirs, name
    md = {d: read_metadata_safely(tmp_path / d / METADATA_FILE).storage_data for d in ("ours", "dcp")}
    assert {k.fqn: (v.offset, v.length) for k, v in md["ours"].items()} == \
           {k.fqn: (v.offset, v.length) for k, v in md["dcp"].items()}
    back = {k: torch.empty_like(v) for k, v in tensors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({}, storage_reader=FileSystemReader(str(tmp_path / "ours")),
                 planner=ChunkLoadPlanner(full_items(back)), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def test_a_changed_byte_in_a_templated_header_is_refused(tmp_path, monkeypatch):
    """A byte flipped in the zip header or trailer of a tensor written from its template (the
    second of its layout) is caught by the block checksums on load, naming the file."""
    monkeypatch.setattr(integrity, "BLOCK", 4096)
    tensors = {"a": torch.randn(64, 64), "b": torch.randn(64, 64)}
    save_model_full(tmp_path / "ck", Config(), tensors)
    info = {k.fqn: v for k, v in read_metadata_safely(tmp_path / "ck" / METADATA_FILE).storage_data.items()}
    b = info["model/b"]
    payload = tmp_path / "ck" / b.relative_path
    data = payload.read_bytes()
    for at in (b.offset + 40, b.offset + b.length - 30):  # in the head, in the tail
        payload.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:])
        with pytest.raises(CheckpointError, match=rf"{payload.name}: checksum mismatch"):
            load_model_full(tmp_path / "ck")
    payload.write_bytes(data)
    _, back = load_model_full(tmp_path / "ck")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("path", ["template", "torch.save"])
def test_the_scan_finds_an_inf_or_nan_anywhere_and_names_the_first_key(tmp_path, monkeypatch, path):
    """The fused checksum and inf/NaN scan takes each tensor in ``integrity.SCAN``-byte pieces: a NaN in
    the last piece of a tensor is found, an inf too, the first bad key in key order is named
    (here ``b`` although ``c`` is written first), and the checksums of a clean save still equal
    the file's. ``torch.save``: tensors whose storage is not handed over whole (no template) are
    checked on their own."""
    monkeypatch.setattr(integrity, "SCAN", 4096)
    if path == "torch.save":
        monkeypatch.setattr(payload, "_address", lambda view: -1)
    clean = {"c": torch.randn(10_000), "b": torch.randn(10_000), "a": torch.randn(3)}
    sums = write_items(tmp_path / "ok", full_items(clean), single_process=True, refuse_nonfinite_at=7)
    for name in [n for n in sums if n.endswith(".distcp")]:
        assert sums[name] == integrity.file_checksum(tmp_path / "ok" / name, algorithm=integrity.CURRENT)
    bad = {k: v.clone() for k, v in clean.items()}
    bad["c"][-1], bad["b"][9_000] = float("inf"), float("nan")
    with pytest.raises(CheckpointError, match="refusing to save step 7: model/b holds an inf or NaN on rank 0"):
        write_items(tmp_path / "bad", full_items(bad), single_process=True, refuse_nonfinite_at=7)
    bad["b"] = clean["b"]
    with pytest.raises(CheckpointError, match="model/c holds an inf or NaN"):
        write_items(tmp_path / "bad2", full_items(bad), single_process=True, refuse_nonfinite_at=7)


def test_a_load_read_in_pieces_smaller_than_a_block_is_bitwise_and_catches_a_changed_byte(tmp_path, monkeypatch):
    """The load reads each block ``integrity.SCAN`` bytes at a time, checksumming each piece as
    it arrives: with many pieces per block (and blocks not aligned to the tensors) a load is
    bitwise, and a byte changed in any piece of a block, first, middle or last, is refused."""
    monkeypatch.setattr(integrity, "BLOCK", 64 << 10)
    monkeypatch.setattr(integrity, "SCAN", 3000)
    g = torch.Generator().manual_seed(5)
    tensors = {"a": torch.randn(300, 170, generator=g), "b": torch.randn(50_001, generator=g)}
    save_model_full(tmp_path / "ck", Config(), tensors)
    _, back = load_model_full(tmp_path / "ck")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    payload_file = max((tmp_path / "ck").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = payload_file.read_bytes()
    for at in (100, (64 << 10) + 2999, (64 << 10) + 3000, 3 * (64 << 10) - 1, len(data) - 5):
        payload_file.write_bytes(data[:at] + bytes([data[at] ^ 0x80]) + data[at + 1:])
        with pytest.raises(CheckpointError, match=rf"{payload_file.name}: checksum mismatch in bytes"):
            load_model_full(tmp_path / "ck")
    payload_file.write_bytes(data)
