"""First-use preparation: data paths, preprocessing a corpus once, atomic under racing processes."""

import json
import multiprocessing as mp

import pytest

from paratron.config import DataConfig
from paratron.data import prepare, tokenizer
from paratron.data.indexed import IndexedDataset


def test_parse_data_path():
    assert prepare.parse_data_path(["a"]) == [(1.0, "a")]
    assert prepare.parse_data_path(["0.7", "a", "0.3", "b"]) == [(0.7, "a"), (0.3, "b")]
    assert prepare.parse_data_path([]) == []
    with pytest.raises(ValueError, match="either prefixes, or weight-prefix pairs"):
        prepare.parse_data_path(["0.7", "a", "b"])
    with pytest.raises(ValueError, match="weight -1.0 of 'a' must be > 0"):
        prepare.parse_data_path(["-1", "a"])


def _corpus(tmp_path, n=40):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": f"story {i}: " + "once upon a time " * (i % 5 + 1)}) + "\n"
                            for i in range(n)))
    return path


def test_ensure_dataset_preprocesses_once(tmp_path):
    cfg = DataConfig(corpus=str(_corpus(tmp_path)), data_path=[str(tmp_path / "out" / "c")])
    pairs = prepare.ensure_dataset(cfg, seed=1, progress=False)
    assert pairs == [(1.0, str(tmp_path / "out" / "c"))]
    ds = IndexedDataset(pairs[0][1])
    assert ds.num_documents == 40 and ds[0][-1] == tokenizer.gpt2_bpe().eod
    stamp = (tmp_path / "out" / "c.bin").stat().st_mtime_ns
    assert prepare.ensure_dataset(cfg, seed=1, progress=False) == pairs
    assert (tmp_path / "out" / "c.bin").stat().st_mtime_ns == stamp


def test_ensure_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="data.data_path is empty and data.corpus is not set"):
        prepare.ensure_dataset(DataConfig(), 0)
    with pytest.raises(FileNotFoundError, match=r"data.data_path: .*nope.bin/.idx do not exist"):
        prepare.ensure_dataset(DataConfig(data_path=[str(tmp_path / "nope")]), 0)
    with pytest.raises(ValueError, match="preprocessed into one prefix, but data.data_path lists 2"):
        prepare.ensure_dataset(DataConfig(corpus="x.jsonl", data_path=["a", "b"]), 0)
    with pytest.raises(FileNotFoundError, match="data.corpus='missing.jsonl'"):
        prepare.ensure_dataset(DataConfig(corpus="missing.jsonl", data_path=[str(tmp_path / "m")]), 0)


def test_cache_prefix_is_keyed_by_content_key_and_tokenizer(tmp_path, monkeypatch):
    p = prepare.default_prefix(DataConfig(corpus="data/shakespeare.jsonl"))
    assert p.parts[-3:-1] == ("data", "cache") and p.name.startswith("shakespeare_gpt2-")
    a = _corpus(tmp_path)
    b = tmp_path / "sub" / "c.jsonl"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    cfg = DataConfig(corpus=str(a), cache_dir=str(tmp_path / "cache"))
    key = prepare.default_prefix(cfg)
    assert key.parent == tmp_path / "cache" and key.name.startswith("c_gpt2-")
    assert prepare.default_prefix(DataConfig(corpus=str(b), cache_dir=str(tmp_path / "cache"))) == key
    others = [DataConfig(corpus=str(a), cache_dir=str(tmp_path / "cache"), json_key="body"),
              DataConfig(corpus=str(a), cache_dir=str(tmp_path / "cache"), tokenizer_type="ByteLevelBPE",
                         tokenizer_vocab_size=512)]
    b.write_bytes(a.read_bytes() + b'{"text": "one more"}\n')
    others.append(DataConfig(corpus=str(b), cache_dir=str(tmp_path / "cache")))
    names = {prepare.default_prefix(c).name for c in others}
    assert len(names) == 3 and key.name not in names
    assert any(n.startswith("c_bpe512-") for n in names)
    # Digests are remembered per (path, size, mtime): the next key reads no corpus byte.
    memo = tmp_path / "cache" / ".digests"
    assert len(list(memo.glob("*.digest"))) == 5  # a, b before and after, gpt2 vocab and merges
    real_open = open

    def no_corpus_reads(f, *args, **kwargs):
        assert not str(f).endswith(".jsonl"), f"read {f}"
        return real_open(f, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_corpus_reads)
    assert prepare.default_prefix(cfg) == key


def _race(cfg, q):
    q.put(prepare.ensure_dataset(cfg, seed=0, progress=False))


def test_racing_processes_and_trained_tokenizer(tmp_path):
    cfg = DataConfig(corpus=str(_corpus(tmp_path, 60)), data_path=[str(tmp_path / "r")],
                     tokenizer_type="ByteLevelBPE", tokenizer_vocab_size=300)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(cfg, q)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0] == results[1] == [(1.0, str(tmp_path / "r"))]
    tok = prepare.build_tokenizer(cfg)
    assert tok.vocab_size <= 300
    ds = IndexedDataset(tmp_path / "r")
    assert ds.num_documents == 60 and ds[5].tolist() == tok.encode("story 5: " + "once upon a time " * 1) + [tok.eod]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("r.")) == \
        ["r.bin", "r.idx", "r.meta.json", "r.tokenizer.json"]  # no temporaries left behind


def test_empty_prefix_is_refused_before_launch(tmp_path):
    """A corpus without documents is refused by name; so is an existing prefix with none (the
    ranks used to fail on mmap of an empty .bin)."""
    from paratron.data.indexed import IndexedDatasetWriter

    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"e.jsonl: no documents"):
        prepare.prepare_run_data(DataConfig(corpus=str(tmp_path / "e.jsonl"), cache_dir=str(tmp_path / "c"),
                                            tokenizer_type="GPT2BPETokenizer"), progress=False)
    IndexedDatasetWriter(tmp_path / "empty", "uint16").finalize()
    with pytest.raises(ValueError, match=r"empty.bin/.idx hold no document"):
        prepare.prepare_run_data(DataConfig(data_path=[str(tmp_path / "empty")],
                                            tokenizer_type="GPT2BPETokenizer"), progress=False)
