"""A split too small for one sample, on every path that builds a dataset: one prefix, a blend
(each split its own blend), the whole documents of token-balanced microbatches, and the check
before launch (``paratron.data.split_plan``, ``paratron.training.preflight``).

A held-out split (valid, test) too small is left out with a warning, and a blend draws that
split from the prefixes that have one; a train split too small is refused before launch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from paratron import cli
from paratron.data import gpt_dataset as gd
from paratron.data.blending import BlendedDataset
from paratron.data.indexed import IndexedDataset, IndexedDatasetWriter
from paratron.data.token_batches import document_splits

SPLIT = "98,1,1"  # 100 documents: 98 train, 1 valid, 1 test


def _write(prefix, lengths, base=0) -> str:
    """Document d holds tokens base + 100*d + (0, 1, ...), each below GPT-2's vocabulary."""
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d, n in enumerate(lengths):
            w.add_document(base + 100 * d + np.arange(n))
    return str(prefix)


@pytest.fixture
def prefixes(tmp_path):
    """``small``: 100 documents of 50 tokens (valid and test: 50 tokens each); ``big``: 100 of 500."""
    return {"small": _write(tmp_path / "small", [50] * 100),
            "big": _write(tmp_path / "big", [500] * 100, base=20_000)}


def _build(pairs, seq_length, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = gd.build_datasets(pairs, seq_length, seed=3, split=SPLIT, num_samples=(40, 4, 0),
                                cache_dir=tmp_path / "c")
    return out, [str(w.message) for w in caught]


def test_one_prefix_skips_a_held_out_split_too_small(prefixes, tmp_path):
    (train, valid, test), said = _build([(1.0, prefixes["small"])], 100, tmp_path)
    assert train is not None and valid is None and test is None
    assert any("small: the valid split (1 document, 50 tokens) has too few tokens" in s for s in said), said


def test_a_blend_leaves_out_the_prefix_whose_held_out_split_is_too_small(prefixes, tmp_path):
    """The crash of the blend path: 0.5 small 0.5 big with valid samples of 100 + 1 tokens."""
    pairs = [(0.5, prefixes["small"]), (0.5, prefixes["big"])]
    (train, valid, _), said = _build(pairs, 100, tmp_path)
    assert isinstance(train, BlendedDataset) and len(train.datasets) == 2
    assert isinstance(valid, BlendedDataset) and len(valid.datasets) == 1 and len(valid) == 4
    assert all(int(valid[i]["tokens"][0]) >= 20_000 for i in range(len(valid)))  # all from big
    assert any("small: the valid split" in s and "left out of the blend" in s for s in said), said


def test_each_split_of_a_blend_is_planned_on_its_own(prefixes, tmp_path):
    """Every prefix's valid split too small: no valid dataset (a warning), training unaffected;
    a prefix without valid documents is left out of the valid blend only."""
    pairs = [(0.5, prefixes["small"]), (0.5, prefixes["big"])]
    (train, valid, _), said = _build(pairs, 600, tmp_path)
    assert isinstance(train, BlendedDataset) and valid is None
    assert any("no valid dataset: none of the 2 prefixes" in s for s in said), said
    few = _write(tmp_path / "few", [500] * 20, base=40_000)  # 20 documents: all train under 98,1,1
    (train, valid, _), said = _build([(0.5, few), (0.5, prefixes["small"]), (0.5, prefixes["big"])], 400, tmp_path)
    assert isinstance(valid, BlendedDataset) and len(valid.datasets) == 1 and len(train.datasets) == 3
    assert all(20_000 <= int(valid[i]["tokens"][0]) < 40_000 for i in range(len(valid)))  # all from big
    assert any("few: no valid documents" in s for s in said) and any("small: the valid split" in s for s in said)


def test_a_train_split_too_small_is_an_error_naming_the_prefix(prefixes, tmp_path):
    with pytest.raises(ValueError, match=r"small: the train split \(98 documents, 4900 tokens\) has too few"):
        _build([(0.5, prefixes["small"]), (0.5, prefixes["big"])], 5000, tmp_path)


def test_whole_documents_follow_the_same_rule(tmp_path):
    """Token-balanced microbatches: a valid split whose documents have nothing to predict (1 token
    each) is skipped with a warning; such a train split is an error."""
    prefix = _write(tmp_path / "ones", [30] * 98 + [1, 1])
    with pytest.warns(UserWarning, match=r"ones: the valid split \(1 document, 1 tokens\) has too few tokens"):
        train, valid = document_splits(prefix, SPLIT)
    assert valid is None and len(train) == 98
    with pytest.raises(ValueError, match=r"the train split \(98 documents, 98 tokens\) has too few tokens"):
        document_splits(_write(tmp_path / "empty", [1] * 100), SPLIT)


SMALL_RUN = ["model.hidden_size=32", "model.num_layers=1", "model.num_attention_heads=4",
             "train.micro_batch_size=1", "train.global_batch_size=2", "train.train_iters=1",
             "train.eval_iters=1", "train.sample_tokens=0", "logging.tensorboard=false",
             "logging.progress=false", f"data.split={SPLIT}"]


def _argv(tmp_path, data_path: list[str], extra: list[str]) -> list[str]:
    argv = ["train", "--run-dir", str(tmp_path / "run"), "--data-path", *data_path]
    for o in SMALL_RUN + [f"data.cache_dir={tmp_path / 'c'}"] + extra:
        argv += ["--set", o]
    return argv


@pytest.fixture
def launches(monkeypatch):
    """Every torchrun the launcher would start (none is: each returns 0 at once)."""
    import paratron.launch.launch as launch

    started = []
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd, *a, **k: started.append(cmd) or 0)
    return started


@pytest.mark.parametrize("path", ["one prefix", "blend", "token-balanced"])
def test_the_check_before_launch_warns_once_on_every_path(prefixes, tmp_path, capsys, launches, path):
    data = {"one prefix": [prefixes["small"]], "blend": ["0.5", prefixes["small"], "0.5", prefixes["big"]],
            "token-balanced": [_write(tmp_path / "ones", [30] * 98 + [1, 1])]}[path]
    extra = ["model.seq_length=100"] + (["data.microbatch_tokens=100"] if path == "token-balanced" else [])
    assert cli.main(_argv(tmp_path, data, extra) + ["--nproc-per-node", "2"]) == 0
    assert len(launches) == 1
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("paratron: warning:") and "valid split" in line]
    assert len(warned) == 1 and "has too few tokens for one sample" in warned[0], err


@pytest.mark.parametrize("path", ["one prefix", "blend", "token-balanced"])
def test_a_train_split_too_small_is_refused_before_launch(prefixes, tmp_path, capsys, launches, path):
    data = {"one prefix": [prefixes["small"]], "blend": ["0.5", prefixes["small"], "0.5", prefixes["big"]],
            "token-balanced": [_write(tmp_path / "ones", [1] * 100)]}[path]
    extra = ["model.seq_length=64", "data.microbatch_tokens=64"] if path == "token-balanced" else \
        ["model.seq_length=5000"]
    assert cli.main(_argv(tmp_path, data, extra) + ["--nproc-per-node", "2"]) == 2
    assert launches == []
    err = capsys.readouterr().err
    assert "paratron train: config error:" in err and "the run cannot train" in err, err
    assert any(f"{prefix}: the train split (" in err for prefix in data), err


def test_a_blend_with_a_held_out_split_too_small_trains(prefixes, tmp_path, capsys):
    """End to end in one process: the blend that crashed at start-up trains and evaluates."""
    data = ["0.5", prefixes["small"], "0.5", prefixes["big"]]
    assert cli.main(_argv(tmp_path, data, ["model.seq_length=100", "train.eval_interval=1"])) == 0
    out = capsys.readouterr()
    assert "validation at iteration 1" in out.out
    assert out.err.count("small: the valid split") == 1, out.err  # once, before launch
