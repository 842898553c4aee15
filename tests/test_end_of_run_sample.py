"""The text sample ``paratron train`` prints after the last step: ``train.sample_prompt = none``
(or an empty string) turns it off, and its log line names what it sampled from: the checkpoint
this run saved, else the in-memory model (a resumed run with no step left saves none)."""

from __future__ import annotations

import pytest

from paratron.config import to_toml
from paratron.config.loading import load_config
from paratron.local_ranks import run_ranks

from test_e2e_train import TINY


def _train_in_rank(argv):
    from paratron.cli import main

    return main(argv)


def _train(run_dir, corpus, *sets) -> None:
    argv = ["train", "--run-dir", str(run_dir)]
    for o in TINY + corpus + ["data.split=90,10,0", "train.train_iters=2", "train.sample_tokens=4", *sets]:
        argv += ["--set", o]
    assert run_ranks(_train_in_rank, 1, argv, timeout=300) == [0]


@pytest.mark.parametrize("value", ["none", '""'])
def test_sample_prompt_none_or_empty_is_no_sample_and_reads_back(value, tmp_path):
    cfg = load_config(None, [f"train.sample_prompt={value}"])
    assert cfg.train.sample_prompt is None and load_config(None).train.sample_prompt == "auto"
    # The run directory's config.toml (a relaunch reads it) keeps the sample off.
    (tmp_path / "c.toml").write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(tmp_path / "c.toml").train.sample_prompt is None


def test_end_of_run_sample_off_saved_and_in_memory(tmp_path, tiny_corpus, capfd):
    _train(tmp_path / "off", tiny_corpus, "train.sample_prompt=none")
    assert "sample from" not in capfd.readouterr().out

    _train(tmp_path / "on", tiny_corpus, "checkpoint.save=none")  # none: RUN_DIR/checkpoints
    out = capfd.readouterr().out
    assert f"sample from the saved checkpoint {tmp_path / 'on' / 'checkpoints' / 'step_2'} " in out

    # Resumed at its last step into a directory of its own: nothing left to train or save.
    _train(tmp_path / "resumed", tiny_corpus, f"checkpoint.load={tmp_path / 'on' / 'checkpoints'}",
           'train.sample_prompt="KING: "')
    out = capfd.readouterr().out
    assert "sample from the in-memory model (this run saved no checkpoint)" in out and "KING: " in out
