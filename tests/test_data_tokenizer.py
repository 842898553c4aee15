"""Tokenizers: GPT-2 BPE ids, tokenizer.json loading, a trained byte-level BPE, build_tokenizer."""

import inspect

import pytest

from paratron.config import DataConfig
from paratron.data import tokenizer
from paratron.data.prepare import build_tokenizer


def test_gpt2_hello_world():
    tok = tokenizer.gpt2_bpe()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eod == 50256 and tok.vocab_size == 50257
    text = "ROMEO. But soft, what light through yonder window breaks?\n\n  x"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(["Hello world", "x"]) == [[15496, 995], tok.encode("x")]


def test_gpt2_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    from paratron.data import paths
    vocab, merges = str(paths.bundled("gpt2-bpe/vocab.json")), str(paths.bundled("gpt2-bpe/merges.txt"))
    # transformers 5 names the files vocab/merges; 4.x named them vocab_file/merges_file.
    new = "vocab" in inspect.signature(transformers.GPT2TokenizerFast.__init__).parameters
    ref = transformers.GPT2TokenizerFast(**({"vocab": vocab, "merges": merges} if new else
                                            {"vocab_file": vocab, "merges_file": merges}))
    assert ref("Hello world")["input_ids"] == [15496, 995]
    ours = tokenizer.gpt2_bpe()
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York; 1592 ’tis\t ok"
    assert ours.encode(text) == ref(text)["input_ids"]


def test_build_tokenizer_from_config(tmp_path):
    tok = build_tokenizer(DataConfig())
    assert tok.encode("Hello world") == [15496, 995]
    path = tmp_path / "tok.json"
    tok.save(path)
    hf = build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path)))
    assert hf.encode("Hello world") == [15496, 995] and hf.eod == 50256
    with pytest.raises(ValueError, match="HuggingFaceTokenizer' needs tokenizer_model"):
        build_tokenizer(DataConfig(tokenizer_type="HuggingFaceTokenizer"))
    with pytest.raises(FileNotFoundError, match="vocab_file='missing.json'"):
        build_tokenizer(DataConfig(vocab_file="missing.json"))


def test_trained_byte_level_bpe(tmp_path):
    texts = ["the quick brown fox jumps over the lazy dog. " * 20, "to be or not to be, that is the question"]
    tok = tokenizer.train_byte_level_bpe(texts, 300)
    assert tok.vocab_size <= 300 and tok.eod == 0
    ids = tok.encode(texts[1])
    assert tok.decode(ids) == texts[1] and max(ids) < tok.vocab_size
    assert len(tok.encode(texts[0])) < len(texts[0].encode()) / 2  # it learnt merges
    assert tok.decode(tok.encode("ünïcode ✓")) == "ünïcode ✓"  # every byte is covered
    with pytest.raises(ValueError, match="tokenizer_vocab_size=100 must be >= 257"):
        tokenizer.train_byte_level_bpe(texts, 100)
