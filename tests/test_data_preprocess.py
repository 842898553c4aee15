"""``paratron preprocess``: the bundled corpus, workers, Megatron flags and naming, bad input."""

import json

import numpy as np
import pytest

from paratron import cli
from paratron.data import paths, tokenizer
from paratron.data.indexed import IndexedDataset
from paratron.data.preprocess import preprocess


def test_bundled_corpus(tmp_path):
    corpus = paths.bundled("shakespeare.jsonl")
    tok = tokenizer.gpt2_bpe()
    res = preprocess([str(corpus)], str(tmp_path / "shk"), tok, workers=2, progress=False)
    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    ds = IndexedDataset(tmp_path / "shk")
    assert res.documents == ds.num_documents == len(texts) == 597
    counts = [len(x) for x in tok.encode_batch(texts)]
    assert int(ds.sequence_lengths.sum()) == res.tokens == sum(counts) + 597
    np.testing.assert_array_equal(ds.sequence_lengths, np.asarray(counts) + 1)
    for i in (0, 296, 596):
        doc = ds[i]
        assert doc[-1] == tok.eod and tok.decode(doc[:-1]) == texts[i]
    assert ds.dtype == np.uint16


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_cli_workers_and_megatron_flags(tmp_path, capsys):
    rows = [{"text": f"document {i} " + "words " * (i % 17), "title": f"t{i}"} for i in range(60)]
    src = _jsonl(tmp_path / "in.jsonl", rows)
    base = ["preprocess", "--input", str(src), "--quiet"]
    assert cli.main(base + ["--output-prefix", str(tmp_path / "w1"), "--workers", "1"]) == 0
    assert cli.main(base + ["--output-prefix", str(tmp_path / "w2"), "--workers", "2"]) == 0
    for ext in ("bin", "idx"):  # documents keep their order whatever the workers
        assert (tmp_path / f"w1.{ext}").read_bytes() == (tmp_path / f"w2.{ext}").read_bytes()
    out = capsys.readouterr().out
    assert "60 documents" in out
    # Megatron's own flags, and its PREFIX_<key>_document naming.
    gpt2 = paths.bundled("gpt2-bpe/vocab.json").parent
    assert cli.main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "m"),
                     "--json-keys", "text", "title", "--tokenizer-type", "GPT2BPETokenizer",
                     "--vocab-file", str(gpt2 / "vocab.json"), "--merge-file", str(gpt2 / "merges.txt"),
                     "--append-eod", "--workers", "1", "--log-interval", "100", "--quiet"]) == 0
    text, title = IndexedDataset(tmp_path / "m_text_document"), IndexedDataset(tmp_path / "m_title_document")
    np.testing.assert_array_equal(text[5], IndexedDataset(tmp_path / "w1")[5])
    tok = tokenizer.gpt2_bpe()
    assert title[7].tolist() == tok.encode("t7") + [tok.eod]
    assert cli.main(base + ["--output-prefix", str(tmp_path / "n"), "--no-append-eod"]) == 0
    assert IndexedDataset(tmp_path / "n")[3].tolist() == tok.encode(rows[3]["text"])


def test_text_files_and_other_key(tmp_path):
    (tmp_path / "a.txt").write_text("First document.\nSecond line.\n", encoding="utf-8")
    _jsonl(tmp_path / "b.jsonl", [{"body": "alpha"}, {"body": "beta"}])
    tok = tokenizer.gpt2_bpe()
    preprocess([str(tmp_path / "a.txt")], str(tmp_path / "t"), tok, progress=False)
    assert IndexedDataset(tmp_path / "t")[0].tolist() == tok.encode("First document.\nSecond line.\n") + [tok.eod]
    preprocess([str(tmp_path / "b.jsonl")], str(tmp_path / "k"), tok, keys=["body"], progress=False)
    assert IndexedDataset(tmp_path / "k")[1].tolist() == tok.encode("beta") + [tok.eod]


def test_byte_level_bpe_trained_on_input(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", [{"text": "a rose by any other name " * (i + 1)} for i in range(30)])
    assert cli.main(["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "b"),
                     "--tokenizer-type", "ByteLevelBPE", "--vocab-size", "300", "--quiet"]) == 0
    tok = tokenizer.from_file(tmp_path / "b.tokenizer.json")
    ds = IndexedDataset(tmp_path / "b")
    assert ds[2].tolist() == tok.encode("a rose by any other name " * 3) + [tok.eod]
    assert int(max(d.max() for d in ds[:])) < tok.vocab_size <= 300


GOOD = b'{"text": "fine"}\n'
BAD_CASES = [
    ("json", GOOD + b'{"text": "unterminated\n' + GOOD, r"bad\.jsonl:2: malformed JSON"),
    ("key", GOOD + GOOD + b'{"body": "x"}\n', r"bad\.jsonl:3: missing key 'text' \(keys: 'body'\)"),
    ("utf8", b'{"text": "caf\xe9"}\n' + GOOD, r"bad\.jsonl:1: not valid UTF-8 \(byte 0xe9 at column 14\)"),
    ("type", GOOD + b'{"text": 5}\n', r"bad\.jsonl:2: key 'text' holds int, not a string"),
]


@pytest.mark.parametrize("case,data,message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_names_file_and_line(tmp_path, capsys, case, data, message):
    (tmp_path / "bad.jsonl").write_bytes(data)
    args = ["preprocess", "--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "o"), "--quiet"]
    assert cli.main(args) == 1
    assert __import__("re").search(message, capsys.readouterr().err)
    assert not (tmp_path / "o.idx").exists() and not (tmp_path / "o.bin").exists()
    assert cli.main(args + ["--skip-bad-lines"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 bad lines" in out and __import__("re").search(message, out)
    assert IndexedDataset(tmp_path / "o").num_documents == data.count(b"\n") - 1


def test_bad_text_file_and_missing_input(tmp_path, capsys):
    (tmp_path / "t.txt").write_bytes(b"line one\nline two \xff\xfe\n")
    assert cli.main(["preprocess", "--input", str(tmp_path / "t.txt"), "--output-prefix", str(tmp_path / "o")]) == 1
    assert "t.txt:2: not valid UTF-8 (byte 0xff at column 10)" in capsys.readouterr().err
    assert cli.main(["preprocess", "--input", str(tmp_path / "none.jsonl"), "--output-prefix", "o"]) == 1
    assert "none.jsonl: no such file or directory" in capsys.readouterr().err


def _square_or_fail(x):
    if x == 7:
        raise KeyError("seven")
    return x * x


def test_ordered_map_keeps_order_and_reports_worker_errors():
    from paratron.data.workers import WorkerError, ordered_map
    assert list(ordered_map(_square_or_fail, range(7), workers=2)) == [x * x for x in range(7)]
    with pytest.raises(WorkerError, match="KeyError: 'seven'"):
        list(ordered_map(_square_or_fail, range(20), workers=2))


@pytest.mark.parametrize("data", [b"", b"\n  \n\n"], ids=["empty", "blank-lines"])
def test_input_without_documents_is_refused(tmp_path, capsys, data):
    """An empty corpus used to write an empty .bin that the ranks then failed to memory-map."""
    (tmp_path / "e.jsonl").write_bytes(data)
    args = ["preprocess", "--input", str(tmp_path / "e.jsonl"), "--output-prefix", str(tmp_path / "o")]
    assert cli.main(args) == 1
    assert "e.jsonl: no documents (empty, or only blank lines)" in capsys.readouterr().err
    assert not list(tmp_path.glob("o.*"))  # nothing written, so a later run does not reuse it
