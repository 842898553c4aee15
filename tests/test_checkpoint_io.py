"""One-process checkpoint I/O: full save/load round trips, sharded loads into marked params, safety."""

import os
import pickle
import shutil

import pytest
import torch

from paratron.checkpoint.io import (MANIFEST, load_model_full, load_model_into, read_items, resolve,
                                    save_model_full, verify_directory)
from paratron.checkpoint.items import CheckpointError, SavedChunk
from paratron.checkpoint.safety import METADATA_FILE, model_config_differences
from paratron.config import Config
from paratron.parallel.params import ShardSpec, mark


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "embedding.word_embeddings.weight": torch.randn(10, 6, generator=g),
        "layers.0.mlp.fc1.bias": torch.randn(8, generator=g),
        "layers.0.mlp.fc1.weight": torch.randn(8, 6, generator=g).bfloat16(),
        "counter": torch.arange(7, dtype=torch.int64),
    }


def test_full_round_trip_is_bitwise(tmp_path):
    cfg = Config()
    cfg.model.hidden_size = 6
    t = _tensors()
    save_model_full(tmp_path / "ck", cfg, t)
    cfg2, t2 = load_model_full(tmp_path / "ck")
    assert cfg2.to_dict() == cfg.to_dict()
    assert sorted(t2) == sorted(t)
    for k, v in t.items():
        assert t2[k].dtype == v.dtype and torch.equal(t2[k], v), k
    assert (tmp_path / "ck" / "config.toml").read_text().startswith("[model]")


def test_save_refuses_existing_checkpoint(tmp_path):
    save_model_full(tmp_path / "ck", Config(), _tensors())
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        save_model_full(tmp_path / "ck", Config(), _tensors())


def _sharded_params(rows_per_rank_layout):
    """Params of a vocab-parallel-like [10, 6] table split by rows, each with 2 padding rows."""
    params = []
    start = 0
    for n in rows_per_rank_layout:
        p = torch.nn.Parameter(torch.full((n + 2, 6), -1.0))
        mark(p, "embedding.word_embeddings.weight",
             ShardSpec((10, 6), (start, 0), (n, 6)), partition_dim=0)
        params.append(p)
        start += n
    return params


def test_load_model_into_reshards_and_keeps_padding(tmp_path):
    t = _tensors()
    save_model_full(tmp_path / "ck", Config(), t)
    full = t["embedding.word_embeddings.weight"]
    for layout in ([10], [5, 5], [3, 7], [2, 2, 2, 4]):
        start = 0
        for p in _sharded_params(layout):
            module = torch.nn.Module()
            module.w = p
            load_model_into(tmp_path / "ck", [module])
            n = p.meta.shard.local_shape[0]
            assert torch.equal(p.data[:n], full[start:start + n]), layout
            assert torch.all(p.data[n:] == -1.0), "padding rows must be left as they were"
            start += n


def test_load_into_2d_rectangles_of_several_chunks(tmp_path):
    """Three rectangles (as a ZeRO-1 slice of a flattened param gives) of one tensor on one rank."""
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save_model_full(tmp_path / "ck", Config(), {"w": w})
    flat = torch.zeros(11)
    # elements [4, 15) of the flattened [4, 6] tensor: rows 0[4:6], 1[0:6], 2[0:3]
    pieces = [SavedChunk(flat[0:2].view(1, 2), (0, 4), (4, 6)),
              SavedChunk(flat[2:8].view(1, 6), (1, 0), (4, 6)),
              SavedChunk(flat[8:11].view(1, 3), (2, 0), (4, 6))]
    read_items(tmp_path / "ck", {"model/w": pieces})
    assert torch.equal(flat, w.flatten()[4:15])


def test_missing_key_and_wrong_shape_are_named(tmp_path):
    save_model_full(tmp_path / "ck", Config(), {"w": torch.zeros(4, 6)})
    with pytest.raises(CheckpointError, match="model/v is not in the checkpoint"):
        read_items(tmp_path / "ck", {"model/v": [SavedChunk(torch.zeros(2), (0,), (2,))]})
    with pytest.raises(CheckpointError, match=r"model/w has shape \(4, 6\) in the checkpoint but \(4, 5\)"):
        read_items(tmp_path / "ck", {"model/w": [SavedChunk(torch.zeros(4, 5), (0, 0), (4, 5))]})


class _Payload:
    """Unpickling this calls os.system, which would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _reseal(directory, keep_sha256=False):
    """Rewrite a checkpoint's manifest to match its (tampered) files: hash, checksums, own crc,
    so that only the loaders' refusal to unpickle stands between the files and a load."""
    import json

    from paratron.checkpoint import integrity
    from paratron.checkpoint.safety import file_sha256

    man = json.loads((directory / MANIFEST).read_text())
    if not keep_sha256:
        man["metadata_sha256"] = file_sha256(directory / METADATA_FILE)
    man["checksums"] = integrity.checksum_files(directory, man["checksums"])
    (directory / MANIFEST).write_bytes(integrity.seal_manifest(man))


def test_crafted_metadata_pickle_is_refused_without_running(tmp_path):
    save_model_full(tmp_path / "ck", Config(), _tensors())
    marker = tmp_path / "pwned"
    md = tmp_path / "ck" / METADATA_FILE
    md.write_bytes(pickle.dumps(_Payload(marker)))
    # Even with the manifest's hash and checksums updated to match, the payload is refused before it runs.
    _reseal(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        load_model_full(tmp_path / "ck")
    assert not marker.exists()


def test_swapped_metadata_is_refused_by_hash(tmp_path):
    save_model_full(tmp_path / "a", Config(), _tensors())
    save_model_full(tmp_path / "b", Config(), {"w": torch.zeros(3)})
    shutil.copy(tmp_path / "b" / METADATA_FILE, tmp_path / "a" / METADATA_FILE)
    with pytest.raises(CheckpointError, match=r"\.metadata: (truncated|checksum mismatch)"):
        load_model_full(tmp_path / "a")
    _reseal(tmp_path / "a", keep_sha256=True)  # checksums made to match: the sha256 still refuses it
    with pytest.raises(CheckpointError, match="sha256"):
        load_model_full(tmp_path / "a")


def test_pickle_files_and_foreign_dirs_are_refused(tmp_path):
    save_model_full(tmp_path / "ck", Config(), _tensors())
    torch.save({"x": 1}, tmp_path / "ck" / "extra.pt")
    with pytest.raises(CheckpointError, match=r"extra\.pt.*no pickle files"):
        verify_directory(tmp_path / "ck")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match="not a paratron checkpoint"):
        verify_directory(tmp_path / "plain")


def test_crafted_tensor_payload_is_refused(tmp_path):
    """A tensor record replaced by a pickle naming os.system, with the metadata and the manifest
    rewritten to match it, is refused by the weights-only tensor reader without running."""
    import dataclasses

    from paratron.checkpoint.safety import read_metadata_safely

    save_model_full(tmp_path / "ck", Config(), {"w": torch.zeros(3)})
    marker = tmp_path / "pwned"
    (data,) = [p for p in (tmp_path / "ck").iterdir() if p.suffix == ".distcp"]
    torch.save(_Payload(marker), data)
    md_path = tmp_path / "ck" / METADATA_FILE
    md = read_metadata_safely(md_path)
    md.storage_data = {k: dataclasses.replace(v, offset=0, length=data.stat().st_size)
                       for k, v in md.storage_data.items()}
    md_path.write_bytes(pickle.dumps(md))
    _reseal(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="reading the tensors failed.*[Ww]eights only"):
        load_model_full(tmp_path / "ck")
    assert not marker.exists()


def test_model_config_differences_name_fields():
    a, b = Config(), Config()
    b.model.hidden_size = 512
    b.model.activation = "swiglu"
    b.model.recompute = "full"  # execution only: not a difference
    diff = model_config_differences(a.to_dict()["model"], b.to_dict()["model"])
    assert diff == ["model.activation: checkpoint 'gelu', this run 'swiglu'",
                    "model.hidden_size: checkpoint 256, this run 512"]
    with pytest.raises(CheckpointError, match="model.hidden_size"):
        load_model_into_check(a, b)


def load_model_into_check(a, b):
    from paratron.checkpoint.safety import check_same_model
    check_same_model(a.to_dict()["model"], b.to_dict()["model"], "ck")


def test_resolve_latest_and_step(tmp_path):
    save_model_full(tmp_path / "root" / "step_4", Config(), {"w": torch.ones(2)})
    (tmp_path / "root" / "latest").write_text("step_4\n")
    assert resolve(tmp_path / "root") == tmp_path / "root" / "step_4"
    assert resolve(tmp_path / "root", 4) == tmp_path / "root" / "step_4"
    with pytest.raises(CheckpointError, match="no checkpoint for step 5.*step_4"):
        resolve(tmp_path / "root", 5)
    _, t = load_model_full(tmp_path / "root")
    assert torch.equal(t["w"], torch.ones(2))


def test_checkpoint_older_than_a_model_field_still_loads():
    """A checkpoint saved before a model field existed does not record it: the field counts as
    its default (a run at the default resumes; one that changes it is refused). Fields that only
    choose how the experts compute (GEMM method, bias update rate, drop policy) never refuse."""
    old = Config().to_dict()["model"]
    for k in ("moe_router_norm_topk_prob", "moe_shared_expert_gate", "moe_expert_gemm"):
        del old[k]
    now = Config()
    assert model_config_differences(old, now.to_dict()["model"]) == []
    now.model.moe_shared_expert_gate = True
    now.model.moe_expert_gemm = "bmm"
    assert model_config_differences(old, now.to_dict()["model"]) == [
        "model.moe_shared_expert_gate: checkpoint False, this run True"]
