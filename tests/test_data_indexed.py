"""Indexed .bin/.idx files: round trip, Megatron byte layout both ways, pointer arithmetic, errors."""

import struct

import numpy as np
import pytest

from paratron.data import indexed
from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter, merge_datasets


def _docs(rng, vocab, n=20):
    docs = [rng.integers(0, vocab, size=int(rng.integers(1, 300))) for _ in range(n)]
    docs[3] = np.zeros(0, dtype=np.int64)  # an empty document must survive too
    return docs


@pytest.mark.parametrize("vocab", [50257, 128256])
def test_round_trip(tmp_path, vocab):
    rng = np.random.default_rng(0)
    docs = _docs(rng, vocab)
    docs[0][:2] = [vocab - 1, 0]  # the extremes of the vocabulary
    dtype = indexed.optimal_dtype(vocab)
    assert dtype == (np.uint16 if vocab < 65500 else np.int32)
    with IndexedDatasetWriter(tmp_path / "d", dtype) as w:
        for d in docs:
            w.add_document(d)
    ds = IndexedDataset(tmp_path / "d")
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == len(docs) == ds.num_documents
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        np.testing.assert_array_equal(ds.get_document(i), d)
    np.testing.assert_array_equal(ds.sequence_lengths, [len(d) for d in docs])
    np.testing.assert_array_equal(ds.document_indices, np.arange(len(docs) + 1))
    np.testing.assert_array_equal(ds.get(0, 5, 7), docs[0][5:12])
    assert (tmp_path / "d.bin").stat().st_size == sum(len(d) for d in docs) * np.dtype(dtype).itemsize
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]  # no temporaries left


def test_multi_sequence_documents_and_merge(tmp_path):
    rng = np.random.default_rng(1)
    a = [[rng.integers(0, 1000, 5), rng.integers(0, 1000, 3)], [rng.integers(0, 1000, 4)]]
    with IndexedDatasetWriter(tmp_path / "a", np.uint16) as w:
        for doc in a:
            w.add_sequences(doc)
    with IndexedDatasetWriter(tmp_path / "b", np.uint16) as w:
        w.add_flat(np.arange(10), [6, 4])
    ds = IndexedDataset(tmp_path / "a")
    np.testing.assert_array_equal(ds.document_indices, [0, 2, 3])
    np.testing.assert_array_equal(ds.document_lengths, [8, 4])
    np.testing.assert_array_equal(ds.get_document(0, 3, 4), np.concatenate(a[0])[3:7])
    m = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    np.testing.assert_array_equal(m.document_indices, [0, 2, 3, 4, 5])
    expect = [np.concatenate(a[0]), a[1][0], np.arange(6), np.arange(6, 10)]
    for i, e in enumerate(expect):
        np.testing.assert_array_equal(m.get_document(i), e)
    with IndexedDatasetWriter(tmp_path / "c", np.int32) as w:
        w.add_document([1])
    with pytest.raises(ValueError, match=r"c\.idx holds int32 tokens; this writer writes uint16"):
        merge_datasets([tmp_path / "a", tmp_path / "c"], tmp_path / "m2")


def _handmade(prefix, dtype_code, dtype, seqs, doc_idx):
    """The Megatron v1 layout, spelled out byte by byte independently of paratron's writer."""
    lengths = [len(s) for s in seqs]
    pointers, off = [], 0
    for n in lengths:
        pointers.append(off)
        off += n * np.dtype(dtype).itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", dtype_code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(seqs)}i", *lengths))
        f.write(struct.pack(f"<{len(seqs)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())


@pytest.mark.parametrize("code,dtype", [(8, np.uint16), (4, np.int32)])
def test_reads_handmade_megatron_files(tmp_path, code, dtype):
    seqs = [[1, 2, 3], [60000 if dtype == np.uint16 else 100000, 5], [], [7, 8, 9, 10]]
    _handmade(tmp_path / "h", code, dtype, seqs, [0, 2, 4])
    ds = IndexedDataset(tmp_path / "h")
    assert ds.dtype == np.dtype(dtype) and len(ds) == 4 and ds.num_documents == 2
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    assert ds.get_document(0).tolist() == seqs[0] + seqs[1]
    assert ds.get_document(1).tolist() == seqs[3]
    # And paratron writes exactly these bytes for the same content.
    with IndexedDatasetWriter(tmp_path / "p", dtype) as w:
        w.add_sequences(seqs[:2])
        w.add_sequences(seqs[2:])
    for ext in ("bin", "idx"):
        assert (tmp_path / f"p.{ext}").read_bytes() == (tmp_path / f"h.{ext}").read_bytes()


@pytest.mark.parametrize("vocab", [50257, 128256])
def test_megatron_core_reads_paratron_files(tmp_path, vocab):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(2)
    docs = _docs(rng, vocab)
    with IndexedDatasetWriter(tmp_path / "d", indexed.optimal_dtype(vocab)) as w:
        for d in docs:
            w.add_document(d)
    theirs = mc.IndexedDataset(str(tmp_path / "d"))
    assert len(theirs) == len(docs)
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    np.testing.assert_array_equal(theirs.sequence_lengths, [len(d) for d in docs])
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
    np.testing.assert_array_equal(theirs.get(5, offset=3, length=10), docs[5][3:13])


def test_pointers_pass_2_pow_31():
    lengths = np.full(3, 2**30, dtype=np.int32)
    p = indexed.sequence_pointers(lengths, np.uint16)
    assert p.dtype == np.int64
    assert p.tolist() == [0, 2**31, 2**32]


def test_bad_files_name_the_file(tmp_path):
    with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
        w.add_document([1, 2, 3])
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "x.bin").write_bytes((tmp_path / "d.bin").read_bytes())
    (tmp_path / "x.idx").write_bytes(b"NOTANIDX\x00" + idx[9:])
    with pytest.raises(ValueError, match=r"x\.idx: not a Megatron index"):
        IndexedDataset(tmp_path / "x")
    (tmp_path / "x.idx").write_bytes(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    with pytest.raises(ValueError, match=r"x\.idx: index version 2"):
        IndexedDataset(tmp_path / "x")
    (tmp_path / "x.idx").write_bytes(idx)
    (tmp_path / "x.bin").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match=r"x\.bin: 2 bytes, but .*describes 6"):
        IndexedDataset(tmp_path / "x")
    with pytest.raises(FileNotFoundError, match=r"nope\.idx does not exist"):
        IndexedDataset(tmp_path / "nope")
    with pytest.raises(ValueError, match="has no code"):
        IndexedDatasetWriter(tmp_path / "y", np.uint32)


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as w:
            w.add_document([1, 2])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
