"""GPT dataset: sample windows across documents, splits, epochs, caching, int64 indices, blending."""

import json

import numpy as np
import pytest
import torch

from paratron.data import gpt_dataset as gd
from paratron.data.blending import BlendedDataset, blend_indices
from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter


def _write(prefix, lengths, base=0):
    """Document d holds tokens base + 100*d + (0, 1, ...): every token names its document."""
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d, n in enumerate(lengths):
            w.add_document(base + 100 * d + np.arange(n))
    return IndexedDataset(prefix)


def test_split_ranges():
    assert gd.split_ranges(597, "969,30,1") == [(0, 578), (578, 596), (596, 597)]
    assert gd.split_ranges(10, "8,2") == [(0, 8), (8, 10), (10, 10)]
    assert gd.split_ranges(3, "1/1/1") == [(0, 1), (1, 2), (2, 3)]
    for bad in ("a,b", "1,2,3,4", "0,0", "-1,2"):
        with pytest.raises(ValueError, match=f"split={bad!r}"):
            gd.parse_split(bad)


def test_sample_index_matches_brute_force():
    rng = np.random.default_rng(3)
    lengths = rng.integers(0, 40, size=50)  # zero-length documents included
    stream_pos = np.arange(int(lengths.sum()))
    owner = np.repeat(np.arange(50), lengths)
    start_of = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for seq in (1, 7, 32):
        n = (int(lengths.sum()) - 1) // seq
        idx = gd.build_sample_index(lengths, seq, n)
        assert idx.shape == (n + 1, 2) and idx.dtype == np.int32
        p = stream_pos[np.arange(n + 1) * seq]
        np.testing.assert_array_equal(idx[:, 0], owner[p])
        np.testing.assert_array_equal(idx[:, 1], p - start_of[owner[p]])
    with pytest.raises(ValueError, match="need"):
        gd.build_sample_index(lengths, 32, int(lengths.sum()))


def test_indices_pass_2_pow_31_without_files():
    lengths = np.array([2**31, 2**31], dtype=np.int64)
    idx = gd.build_sample_index(lengths, 2**30, 3)
    assert idx.dtype == np.int64
    assert idx.tolist() == [[0, 0], [0, 2**30], [1, 0], [1, 2**30]]
    assert gd.index_dtype(2**31 - 1) == np.int32 and gd.index_dtype(2**31) == np.int64


def test_samples_are_windows_of_the_document_stream(tmp_path):
    rng = np.random.default_rng(4)
    ds = _write(tmp_path / "d", rng.integers(1, 60, size=40))
    docs = np.arange(5, 35)
    seq = 16
    g = gd.GPTDataset(ds, docs, seq, num_samples=200, seed=7, name="train", cache_dir=tmp_path / "c")
    stream = np.concatenate([ds.get_document(int(d)) for d in g.document_index])
    assert len(g) >= 200 and g.num_epochs > 1
    # Every epoch of the document index is the split's documents, once each, in a fresh order.
    epochs = np.asarray(g.document_index).reshape(g.num_epochs, len(docs))
    for e in epochs:
        assert sorted(e.tolist()) == docs.tolist()
    assert not np.array_equal(epochs[0], epochs[1])
    assert sorted(np.asarray(g.shuffle_index).tolist()) == list(range(len(g)))
    for i in range(len(g)):
        s = int(g.shuffle_index[i])
        np.testing.assert_array_equal(g.sample(i), stream[s * seq: s * seq + seq + 1])
    item = g[3]
    assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (seq,)
    torch.testing.assert_close(item["labels"][:-1], item["tokens"][1:])
    # Shuffling stays within an epoch: the first epoch's block holds only first-epoch samples.
    first_epoch = (np.arange(len(g)) * seq) // g.tokens_per_epoch == 0
    assert set(np.asarray(g.shuffle_index)[:first_epoch.sum()].tolist()) == set(np.flatnonzero(first_epoch).tolist())


def test_cache_reused_only_when_parameters_match(tmp_path):
    ds = _write(tmp_path / "d", [30] * 20)
    cache = tmp_path / "c"
    a = gd.GPTDataset(ds, np.arange(20), 8, 50, seed=1, cache_dir=cache)
    assert len(list(cache.glob("*-description.json"))) == 1
    b = gd.GPTDataset(ds, np.arange(20), 8, 50, seed=1, cache_dir=cache)
    assert isinstance(b.shuffle_index, np.memmap)  # loaded, not rebuilt
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    variants = [dict(seed=2), dict(seq_length=9), dict(documents=np.arange(19)), dict(name="valid")]
    for v in variants:
        kw = dict(indexed=ds, documents=np.arange(20), seq_length=8, num_samples=50, seed=1, cache_dir=cache)
        kw.update(v)
        gd.GPTDataset(**kw)
    assert len(list(cache.glob("*-description.json"))) == 1 + len(variants)
    c = gd.GPTDataset(ds, np.arange(20), 8, 50, seed=2, cache_dir=cache)
    assert not np.array_equal(np.asarray(a.shuffle_index), np.asarray(c.shuffle_index))
    # A stale entry (same name, different stored description) is rebuilt, not trusted.
    desc = next(p for p in cache.glob("d-train-*-description.json")
                if json.loads(p.read_text())["description"]["seed"] == 1
                and json.loads(p.read_text())["description"]["seq_length"] == 8
                and json.loads(p.read_text())["description"]["documents"][2] == 20)
    stored = json.loads(desc.read_text())
    stored["description"]["seed"] = 99
    desc.write_text(json.dumps(stored))
    d = gd.GPTDataset(ds, np.arange(20), 8, 50, seed=1, cache_dir=cache)
    assert not isinstance(d.shuffle_index, np.memmap)
    np.testing.assert_array_equal(a.shuffle_index, d.shuffle_index)
    # Default location: next to the data.
    gd.GPTDataset(ds, np.arange(20), 8, 50, seed=1)
    assert list((tmp_path / "cache").glob("d-train-*-description.json"))


def test_build_datasets_splits(tmp_path):
    _write(tmp_path / "d", [50] * 100)
    tr, va, te = gd.build_datasets([(1.0, str(tmp_path / "d"))], 16, seed=3, split="90,8,2",
                                   num_samples=(500, 20, 0), cache_dir=tmp_path / "c")
    assert te is None and len(tr) >= 500 and len(va) >= 20
    owner = lambda t: set((t // 100).tolist())  # noqa: E731
    train_docs = set().union(*(owner(tr.sample(i)) for i in range(len(tr))))
    valid_docs = set().union(*(owner(va.sample(i)) for i in range(len(va))))
    assert train_docs == set(range(90)) and valid_docs == set(range(90, 98))
    again = gd.build_datasets([(1.0, str(tmp_path / "d"))], 16, seed=3, split="90,8,2",
                              num_samples=(500, 20, 0), cache_dir=tmp_path / "c")[0]
    assert all(torch.equal(tr[i]["tokens"], again[i]["tokens"]) for i in range(0, 500, 37))
    with pytest.warns(UserWarning, match="too few tokens"):
        _, va, _ = gd.build_datasets([(1.0, str(tmp_path / "d"))], 400, seed=3, split="98,1,1")
    assert va is None
    with pytest.raises(ValueError, match="weight 0.0 of"):
        gd.build_datasets([(0.0, str(tmp_path / "d"))], 16, 3)


def test_blend_shares_within_one_percent():
    di, si = blend_indices([0.7, 0.3], 10_000)
    counts = np.bincount(di, minlength=2) / 10_000
    assert abs(counts[0] - 0.7) < 0.01 and abs(counts[1] - 0.3) < 0.01
    # Every prefix of the blend is balanced too, and each dataset is read in order.
    for m in (10, 100, 1000, 9999):
        assert abs(np.sum(di[:m] == 0) - 0.7 * m) <= 1
    for d in (0, 1):
        assert si[di == d].tolist() == list(range(int(np.sum(di == d))))


def test_blended_datasets_from_prefixes(tmp_path):
    _write(tmp_path / "a", [40] * 50)
    _write(tmp_path / "b", [40] * 50, base=1_000_000)
    tr, _, _ = gd.build_datasets([(0.7, str(tmp_path / "a")), (0.3, str(tmp_path / "b"))], 8, seed=5,
                                 split="1,0,0", num_samples=(10_000, 0, 0), cache_dir=tmp_path / "c")
    assert isinstance(tr, BlendedDataset) and len(tr) == 10_000
    from_b = np.array([tr[i]["tokens"][0].item() >= 1_000_000 for i in range(len(tr))])
    assert abs(from_b.mean() - 0.3) < 0.01
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([list(range(10)), list(range(10))], [0.5, 0.5], 100)
