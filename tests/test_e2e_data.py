"""``paratron train --data FILE.jsonl`` end to end on a corpus that is not Shakespeare: tokenised
once before the ranks start, outputs in the run directory, the cache reused by the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIELD_NOTES = ROOT / "tests" / "fixtures" / "field_notes.jsonl"
SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.seq_length=32", "train.micro_batch_size=2",
         "train.global_batch_size=4", "train.eval_iters=1", "train.sample_tokens=8", "logging.tensorboard=false"]


def _train(cwd: Path, extra: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "paratron", "train", "--data", str(FIELD_NOTES), "--nproc-per-node", "2",
            "--train-iters", "3", "--set", f"data.cache_dir={cwd / 'cache'}"]
    for o in extra:
        argv += ["--set", o]
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _check_two_runs(tmp_path: Path, extra: list[str]) -> None:
    first = _train(tmp_path, extra)
    assert "[paratron] tokenising" in first.stderr and "field_notes.jsonl" in first.stderr
    (bin_file,) = (tmp_path / "cache").glob("field_notes_gpt2-*.bin")
    stamp = bin_file.stat().st_mtime_ns
    run = tmp_path / "runs" / "latest"  # the run directory without --config
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_3"
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 3
    # The sample continues the start of a validation document of this corpus.
    assert "sample from the saved checkpoint" in first.stdout and "Field note" in first.stdout

    second = _train(tmp_path, extra)
    assert "[paratron] tokenising" not in second.stderr and "reusing the tokenised corpus" in second.stderr
    assert bin_file.stat().st_mtime_ns == stamp and len(list((tmp_path / "cache").glob("*.bin"))) == 1


def test_train_on_own_jsonl_then_reuse_the_cache(tmp_path):
    _check_two_runs(tmp_path, SMALL)


@pytest.mark.slow
def test_train_on_own_jsonl_default_model(tmp_path):
    """The README's command as written: the built-in defaults (GPT-2 BPE, 4 layers)."""
    _check_two_runs(tmp_path, [])
