"""Progress of the long commands (``plan``, calibration, ``convert``, ``preprocess``): a tqdm bar on
a terminal, nothing with ``--quiet`` or without a terminal (a log); ``plan --gpu cpu`` without a
calibration file calibrates first."""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from paratron.progress import progress_bar, shows

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
        "model.vocab_size=512", "train.global_batch_size=8"]
CAL = {"gemm_flops": 2e10, "nproc": 2, "cores": 2, "mem_bandwidth": 5e9, "op_overhead": 2e-5,
       "gloo_bandwidth": 1e9, "gloo_latency": 2e-4}


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def _terminal(monkeypatch) -> Terminal:
    """Make sys.stderr a terminal for the rest of the test (in its body: pytest's capture sets
    sys.stderr again after the fixtures)."""
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    return term


def test_bar_only_on_a_terminal_and_not_quiet(monkeypatch):
    assert shows(stream=Terminal()) and not shows(quiet=True, stream=Terminal())
    assert not shows(stream=io.StringIO())
    for stream, quiet, drawn in ((Terminal(), False, True), (Terminal(), True, False), (io.StringIO(), False, False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_bar(3, "work", quiet=quiet) as bar:
            bar.update(3)
        assert ("work: 100%" in stream.getvalue()) == drawn, (quiet, stream.getvalue())


def _plan_args(*argv: str) -> argparse.Namespace:
    from paratron.dryrun.plan_command import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = [*argv, "--gpu", "cpu", "--gpus-per-node", "2", "--top-k", "2"]
    for o in TINY:
        args += ["--set", o]
    return p.parse_args(args)


@pytest.mark.parametrize("quiet", [False, True])
def test_plan_shows_layouts_bounded_simulated_pruned_on_a_terminal(quiet, tmp_path, monkeypatch, capsys):
    from paratron.dryrun.plan_command import run

    terminal = _terminal(monkeypatch)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    assert run(_plan_args("--calibration", str(cal), *(["--quiet"] if quiet else []))) == 0
    drawn = terminal.getvalue()
    if quiet:
        assert drawn == ""
    else:
        assert "plan: enumerate: 100%" in drawn and "plan: bound: 100%" in drawn and "plan: simulate: 100%" in drawn
        assert "pruned=" in drawn and "simulated=" in drawn
    assert "1  tp" in capsys.readouterr().out  # the table


def _on_a_terminal(cmd: list[str], timeout: float = 240) -> tuple[int, str]:
    """Run ``cmd`` with a 120-column pseudo-terminal as stdin, stdout and stderr; (exit code, output)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed: every process holding it has ended
                break
            if not chunk:
                break
            out += chunk
        return proc.wait(timeout=max(deadline - time.monotonic(), 1)), out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_plan_on_cpu_calibrates_first_with_progress(tmp_path):
    cal = tmp_path / "runs" / "cal.json"
    cmd = [sys.executable, "-m", "paratron", "plan", "--gpu", "cpu", "--gpus-per-node", "2", "--top-k", "2",
           "--calibration", str(cal)]
    for o in TINY:
        cmd += ["--set", o]
    code, out = _on_a_terminal(cmd)
    assert code == 0, out
    assert f"{cal} does not exist: calibrating this CPU on 2 ranks first" in out
    assert "calibrate: 100%" in out and "5/5" in out and "gloo all-reduce 16 MB done" in out
    figures = json.loads(cal.read_text())
    assert figures["nproc"] == 2 and all(figures[k] > 0 for k in CAL)
    assert "plan: simulate: 100%" in out and "1  tp" in out


def test_calibration_without_a_terminal_draws_no_bar(tmp_path, capsys):
    from paratron.dryrun.plan_command import run

    cal = tmp_path / "cal.json"
    assert run(_plan_args("--calibration", str(cal))) == 0
    err = capsys.readouterr().err
    assert "calibrating this CPU on 2 ranks first" in err
    assert "calibrate:" not in err and "plan:" not in err.replace("paratron plan:", "")  # no bar
    assert json.loads(cal.read_text())["nproc"] == 2


# ---- convert and preprocess -------------------------------------------------------------------
@pytest.fixture
def tiny_checkpoint(tmp_path):
    from paratron.checkpoint.io import save_model_full
    from paratron.config import Config, ModelConfig
    from paratron.models.gpt import build_model_chunks
    from paratron.models.state import gather_full_state
    from paratron.parallel.context import ParallelContext

    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=64,
                        normalization="rmsnorm", position_embedding_type="rope", activation="swiglu",
                        add_bias_linear=False, make_vocab_size_divisible_by=16)
    ctx = ParallelContext.single()
    tensors = gather_full_state(build_model_chunks(model, ctx, seed=0), ctx)
    path = tmp_path / "ckpt"
    save_model_full(path, Config(model=model), tensors)
    return path


def test_convert_shows_its_stages_on_a_terminal_only(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from paratron.cli import main

    term = _terminal(monkeypatch)
    assert main(["convert", "paratron-to-hf", str(tiny_checkpoint), str(tmp_path / "hf")]) == 0
    drawn = term.getvalue()
    assert "convert: writing 1" in drawn and "convert: done" in drawn and "3/3 stages" in drawn
    assert main(["convert", "hf-to-paratron", str(tmp_path / "hf"), str(tmp_path / "back"), "--quiet"]) == 0
    assert term.getvalue() == drawn  # --quiet: nothing more
    monkeypatch.undo()
    assert main(["convert", "hf-to-paratron", str(tmp_path / "hf"), str(tmp_path / "back2")]) == 0
    assert "convert:" not in capsys.readouterr().err  # no terminal


def test_preprocess_bar_on_a_terminal_only(tmp_path, monkeypatch):
    from paratron.data import tokenizer
    from paratron.data.preprocess import preprocess

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(20)))
    tok = tokenizer.gpt2_bpe()
    for stream, drawn in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        preprocess([str(corpus)], str(tmp_path / f"out{int(drawn)}"), tok, progress=True)
        assert ("preprocess: 100%" in stream.getvalue()) == drawn
