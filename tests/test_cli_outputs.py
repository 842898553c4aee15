"""``--output`` of the CLI commands that write a file: a path that cannot be written is an error
naming it (exit code 2), not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("argv", [["info", "--world-size", "2"], ["simulate", "--pipeline", "2"],
                                  ["plan", "--gpu", "h100", "--gpus-per-node", "2", "--top-k", "1"]])
def test_unwritable_output_is_an_error_not_a_traceback(argv, tmp_path, capsys):
    from paratron.cli import main

    target = tmp_path / "missing-dir" / ("out.png" if argv[0] == "simulate" else "out.json")
    assert main([*argv, "--output", str(target)]) == 2
    assert str(target) in capsys.readouterr().err


def test_a_closed_pipe_ends_the_command_quietly():
    """``paratron simulate | head -1`` printed a BrokenPipeError traceback once head had gone."""
    proc = subprocess.Popen([sys.executable, "-m", "paratron", "simulate", "--schedule", "zbv", "--pipeline", "4",
                             "--microbatches", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err
