"""Where a run's tokens come from: vocab sizes from the largest id, the tokenizer record beside a
dataset and the refusal of another tokenizer, ``paratron train --data``, and the pre-launch checks
reading data paths exactly as the data package does. (No import cycle: tests/test_imports.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paratron import cli
from paratron.config import ConfigError, Config, DataConfig
from paratron.data import paths, prepare, preprocess, provenance, tokenizer
from paratron.data.indexed import IndexedDataset
from paratron.launch import launch
from paratron.training import preflight

ROOT = Path(__file__).resolve().parents[1]
FIELD_NOTES = ROOT / "tests" / "fixtures" / "field_notes.jsonl"


def gapped_tokenizer(path: Path) -> Path:
    """1,001 tokens whose ids have gaps: words 0..997, [UNK] 998, 'gap' 65,600 and the special
    end-of-document token '</s>' 70,000 (in the model vocabulary and the added tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(998)}
    vocab.update({"[UNK]": 998, "gap": 65600, "</s>": 70000})
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["</s>"])
    hf.save(str(path))
    return path


def test_vocab_size_is_largest_id_plus_one_for_every_tokenizer(tmp_path):
    gapped = tokenizer.from_file(gapped_tokenizer(tmp_path / "gapped.json"))
    assert len(gapped.hf.get_vocab(with_added_tokens=True)) == 1001
    assert gapped.vocab_size == 70001 and gapped.eod == 70000
    gpt2 = tokenizer.gpt2_bpe()
    trained = tokenizer.train_byte_level_bpe(["some text to learn merges from " * 20], 300)
    for tok in (gapped, gpt2, trained):
        assert tok.vocab_size == max(tok.hf.get_vocab(with_added_tokens=True).values()) + 1
    assert gpt2.vocab_size == 50257


def test_gapped_ids_past_uint16_preprocess_and_round_trip(tmp_path):
    tok = tokenizer.from_file(gapped_tokenizer(tmp_path / "gapped.json"))
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "w1 gap w5"}) + "\n" + json.dumps({"text": "w997"}) + "\n")
    preprocess.preprocess([str(tmp_path / "c.jsonl")], str(tmp_path / "g"), tok, progress=False)
    ds = IndexedDataset(tmp_path / "g")
    assert ds.dtype == np.int32
    assert ds[0].tolist() == [1, 65600, 5, 70000] and ds[1].tolist() == [997, 70000]
    record = provenance.read_record(tmp_path / "g")
    assert record["tokenizer"]["vocab_size"] == 70001 and record["tokenizer"]["fingerprint"] == tok.fingerprint


def _gpt2_dataset(tmp_path) -> Path:
    prefix = tmp_path / "notes_gpt2"
    assert cli.main(["preprocess", "--input", str(FIELD_NOTES), "--output-prefix", str(prefix), "--quiet"]) == 0
    return prefix


def test_tokenizer_mismatch_is_refused_naming_both(tmp_path):
    prefix = _gpt2_dataset(tmp_path)
    gapped = gapped_tokenizer(tmp_path / "gapped.json")
    same = DataConfig(data_path=[str(prefix)])
    assert prepare.prepare_run_data(same, progress=False)[1].name == "gpt2"
    other = DataConfig(data_path=[str(prefix)], tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(gapped))
    with pytest.raises(provenance.TokenizerMismatchError) as e:
        prepare.prepare_run_data(other, progress=False)
    assert "were built with GPT2BPETokenizer gpt2" in str(e.value) and "HuggingFaceTokenizer hf-gapped" in str(e.value)
    untrained = DataConfig(data_path=[str(prefix)], tokenizer_type="ByteLevelBPE")
    with pytest.raises(provenance.TokenizerMismatchError, match="built with GPT2BPETokenizer.*'ByteLevelBPE'"):
        prepare.prepare_run_data(untrained, progress=False)


def _no_launch(monkeypatch):
    """Fail the test if ``paratron train`` gets as far as starting torchrun."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"ranks were launched: {args}")

    monkeypatch.setattr(launch, "run_torchrun", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_train_refuses_a_mismatched_tokenizer_before_launch(tmp_path, monkeypatch, capsys):
    _no_launch(monkeypatch)
    prefix = _gpt2_dataset(tmp_path)
    code = cli.main(["train", "--data", f"{prefix}.bin", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                     "--set", "data.tokenizer_type=ByteLevelBPE"])
    err = capsys.readouterr().err
    assert code == 2 and "config error" in err and "built with GPT2BPETokenizer gpt2" in err
    assert "ByteLevelBPE" in err and not (tmp_path / "run").exists()


def test_train_refuses_a_vocab_smaller_than_the_tokenizer_before_launch(tmp_path, monkeypatch, capsys):
    """GPT-2 BPE has 50,257 ids: model.vocab_size=1000 would index past the embedding on every rank."""
    _no_launch(monkeypatch)
    prefix = _gpt2_dataset(tmp_path)
    code = cli.main(["train", "--data", f"{prefix}.bin", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"),
                     "--set", "model.vocab_size=1000"])
    err = capsys.readouterr().err
    assert code == 2 and "model.vocab_size=1000 is smaller than the tokenizer's vocabulary (50257 ids" in err, err


@pytest.mark.parametrize("tokenizer", [[], ["--set", "data.tokenizer_type=ByteLevelBPE",
                                            "--set", "data.tokenizer_vocab_size=2048"]])
def test_a_too_small_vocab_is_refused_before_the_corpus_is_tokenised(tokenizer, tmp_path, monkeypatch, capsys):
    """The check waited for the whole corpus to be tokenised (minutes on a real one), and for a
    BPE to be trained on it, before it said the model's vocabulary cannot hold the ids."""
    _no_launch(monkeypatch)
    prefix = tmp_path / "cache" / "notes"
    code = cli.main(["train", "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2",
                     "--set", f"data.corpus={FIELD_NOTES}", "--set", f"data.data_path={prefix}",
                     "--set", "model.vocab_size=1000", *tokenizer])
    err = capsys.readouterr().err
    assert code == 2 and "model.vocab_size=1000 is smaller than the tokenizer's vocabulary" in err, err
    assert "tokenising" not in err and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("line,message", [
    (b'{"text": "unterminated\n', r"bad\.jsonl:3: malformed JSON"),
    (b'{"body": "a recipe for bread"}\n',
     r"bad\.jsonl:3: missing key 'text' \(keys: 'body'\) in record \{\"body\": \"a recipe for bread\"\}"),
], ids=["json", "key"])
def test_train_data_reports_the_bad_line_before_launch(tmp_path, monkeypatch, capsys, line, message):
    _no_launch(monkeypatch)
    good = FIELD_NOTES.read_bytes().splitlines(keepends=True)
    (tmp_path / "bad.jsonl").write_bytes(good[0] + good[1] + line + good[2])
    code = cli.main(["train", "--data", str(tmp_path / "bad.jsonl"), "--nproc-per-node", "2",
                     "--run-dir", str(tmp_path / "run"), "--set", f"data.cache_dir={tmp_path / 'cache'}"])
    assert code == 2 and __import__("re").search(message, capsys.readouterr().err)
    assert not list((tmp_path / "cache").glob("*.idx"))


def test_data_argument_replaces_the_config_corpus(tmp_path):
    prefix = _gpt2_dataset(tmp_path)
    cfg = Config(data=DataConfig(corpus="data/shakespeare.jsonl"))
    preflight.apply_data_argument(cfg, str(FIELD_NOTES), [])
    assert (cfg.data.corpus, cfg.data.data_path) == (str(FIELD_NOTES), [])
    preflight.apply_data_argument(cfg, f"{prefix}.idx", [])
    assert (cfg.data.corpus, cfg.data.data_path) == (None, [str(prefix)])
    # Megatron's weighted --data-path (an alias of data.data_path) drops the config file's corpus.
    cfg = Config(data=DataConfig(corpus="data/shakespeare.jsonl", data_path=["0.3", str(prefix), "0.7", str(prefix)]))
    preflight.apply_data_argument(cfg, None, [f"data.data_path=['0.3', '{prefix}', '0.7', '{prefix}']"])
    assert cfg.data.corpus is None
    preflight.check_paths(cfg)
    assert preflight.data_prefixes(cfg) == [(0.3, str(prefix)), (0.7, str(prefix))]


def test_preflight_reads_data_paths_like_the_data_package(tmp_path, monkeypatch):
    cfg = Config(data=DataConfig(data_path=["a", "0.5", "b"]))
    with pytest.raises(ValueError) as data_error:
        prepare.parse_data_path(cfg.data.data_path)
    with pytest.raises(ConfigError) as preflight_error:
        preflight.check_paths(cfg)
    assert str(preflight_error.value) == str(data_error.value)
    # From outside the checkout, a repo-relative corpus resolves as the data package resolves it.
    monkeypatch.chdir(tmp_path)
    cfg = Config(data=DataConfig(corpus="data/shakespeare.jsonl"))
    preflight.check_paths(cfg)
    assert paths.resolve_input(cfg.data.corpus, "data.corpus") == ROOT / "data" / "shakespeare.jsonl"


def test_truncated_bin_is_refused_naming_the_file(tmp_path):
    prefix = _gpt2_dataset(tmp_path)
    preflight.check_dataset_files(str(prefix))
    data = (tmp_path / "notes_gpt2.bin").read_bytes()
    (tmp_path / "notes_gpt2.bin").write_bytes(data[:-6])
    cfg = Config(data=DataConfig(data_path=[str(prefix)]))
    with pytest.raises(ConfigError, match=r"notes_gpt2\.bin: [\d,]+ bytes, but .* describes"):
        preflight.prepare_data(cfg, progress=False)
    (tmp_path / "notes_gpt2.bin").write_bytes(data + b"\0\0")
    with pytest.raises(ConfigError, match="trailing bytes"):
        preflight.prepare_data(cfg, progress=False)
