"""What a rank process does for the launcher: die with its parent, log to a file, report a failure.

* :func:`die_with_parent`: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes, so that a rank
  dies when the torchrun agent that started it dies, however it dies (the launcher sets the same
  on the agent, so killing the launcher ends the agent and then the ranks). If the parent is
  already gone when this runs, the rank exits at once.
* :func:`redirect_output`: under the launcher (``PARATRON_LOG_DIR`` set), everything the rank
  writes (Python and C++, stdout and stderr) goes to ``LOG_DIR/rank_N.log``; rank 0's
  ``print`` output also still reaches the terminal (the progress lines).
* :func:`rank_session`: writes ``LOG_DIR/rank_N.status.json`` (pid, host) at start, and on an
  exception ``LOG_DIR/rank_N.error.json`` (type, message, time, the ``file:line`` of the
  innermost frame outside the Python and site-packages libraries, i.e. in paratron or a plugin,
  the step), prints the traceback to the log and ends the process at once; the launcher's
  summary reads the records (:mod:`paratron.launch.failures`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import sysconfig
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from paratron.checkpoint.io import write_json_atomic
from paratron.launch.mode import started
from paratron.where import package_relpath

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only).

    Returns False where unsupported. Exits the process if the parent has already died (the
    process was re-parented before the request took effect)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:
        os._exit(128 + int(sig))
    return True


class _Tee:
    """A text stream writing to two streams (rank 0's stdout: the log file and the terminal)."""

    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.streams[0].fileno()


def redirect_output(log_dir: Path, rank: int, tee_stdout: bool) -> Path:
    """Send fds 1 and 2 to ``log_dir/rank_N.log`` (appended); with ``tee_stdout``, Python's
    ``sys.stdout`` also goes to the original stdout. Returns the log path."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank_{rank}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(1), "w", buffering=1) if tee_stdout else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    log = os.fdopen(os.dup(1), "w", buffering=1)
    log.write(f"==== rank {rank} pid {os.getpid()} on {socket.gethostname()} at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
    sys.stdout = _Tee(log, terminal) if terminal else log
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    return path


_LIBRARY_DIRS = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep
                       for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def error_location(tb) -> str:
    """``file:line (function)`` of the innermost frame outside the Python and site-packages
    libraries (paratron's own code or a user's plugin); the innermost frame if all are inside."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "?"
    pick = frames[-1]
    for f in reversed(frames):
        real = os.path.realpath(f.filename)
        if not real.startswith(_LIBRARY_DIRS) or package_relpath(real) is not None:
            pick = f
            break
    name = pick.filename
    try:
        name = os.path.relpath(name)
    except ValueError:
        pass
    return f"{name}:{pick.lineno} (in {pick.name})"


def write_error_record(log_dir: Path, rank: int, exc: BaseException) -> None:
    """``log_dir/rank_N.error.json``: what the launcher's summary prints for this rank (the step
    comes from ``exc.paratron_step``, set by the training loop's watchdog callback; the iteration
    of an interrupted checkpoint save from ``exc.paratron_save``, set by the save)."""
    message = str(exc).strip().splitlines()
    record = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
              "type": type(exc).__name__, "message": message[0] if message else "",
              "where": error_location(exc.__traceback__), "step": getattr(exc, "paratron_step", None),
              "save": getattr(exc, "paratron_save", None)}

    log_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(log_dir / f"rank_{rank}.error.json", record)


def record_failure(exc: BaseException) -> None:
    """The error record of a failure the rank ends on by itself with a non-zero exit (a
    non-finite stop), so that the launcher's summary names it like a raised exception.
    Does nothing outside the launcher (no log directory)."""
    me = started()
    if me.under_launcher:
        write_error_record(Path(me.log_dir), me.rank, exc)


@contextmanager
def rank_session():
    """Around a rank's work: the parent-death signal (under torchrun); under the launcher also
    the status record, output to the rank's log, and an error record on an exception (re-raised,
    so that its traceback lands in the log)."""
    me = started()
    if me.torchrun:
        die_with_parent()
    if not me.under_launcher:
        yield
        return
    log_dir, rank = Path(me.log_dir), me.rank
    redirect_output(log_dir, rank, tee_stdout=rank == 0)
    (log_dir / f"rank_{rank}.status.json").write_text(json.dumps(
        {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}))
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        write_error_record(log_dir, rank, exc)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        # End now: the peers are blocked until this process is gone, and the interpreter's
        # teardown has been seen to take seconds here.
        os._exit(1)
