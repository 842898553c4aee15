"""One writer per run: an exclusive lock on a run directory and on its ``checkpoint.save``.

The lock is ``DIR/.paratron.lock``, a file holding the holder's pid, host, start time and
command, locked with ``fcntl.flock`` for as long as the holder lives. The kernel drops a flock
when its process dies (SIGKILL included), so a dead holder's lock is *stale* by construction:
the next job takes it over and says whose it was. A live holder's lock refuses the second job
with :class:`RunLocked`, naming the holder. (``flock`` works on local file systems and on NFS,
where Linux maps it to POSIX locks.)

The launcher (``paratron train --nproc-per-node``) takes the locks before torchrun starts and
keeps them until the job ends; under a bare ``torchrun``, global rank 0 takes them.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

LOCK_NAME = ".paratron.lock"


class RunLocked(RuntimeError):
    """Another live job holds the lock; the message names it (pid, host, start, command)."""


def _describe(info: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("time", 0)))
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')} (since {when}: "
            f"{info.get('command', '?')})")


class RunLock:
    """Exclusive lock on ``directory``. Use :meth:`acquire` / :meth:`release` or ``with``.

    Attributes:
        stale: after :meth:`acquire`, the record of a previous holder that died without
            releasing (None if there was none).
    """

    def __init__(self, directory: Path | str, what: str = "run directory") -> None:
        self.directory = Path(directory)
        self.what = what
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self.stale: dict | None = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`RunLocked` naming the live holder."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read(fd)
            os.close(fd)
            raise RunLocked(f"{self.what} {self.directory} is in use by another paratron job: "
                            f"{_describe(info)}. Wait for it to end or stop it, or use another "
                            f"directory (lock file: {self.path})") from None
        previous = _read(fd)
        if previous.get("pid") is not None and not previous.get("released"):
            self.stale = previous
        info = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                "command": " ".join(sys.argv[:1] + sys.argv[1:6])}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        info = _read(self._fd)
        info["released"] = True
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(info).encode(), 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def lock_run(run_dir: Path | str, save_dir: str | None) -> list[RunLock]:
    """Lock the run directory and (when set and different) ``checkpoint.save``, in that order.

    Raises:
        RunLocked: either is held by a live job (the run directory's lock is released first).
    """
    locks = [RunLock(run_dir).acquire()]
    if save_dir and Path(save_dir).resolve() != Path(run_dir).resolve():
        try:
            locks.append(RunLock(save_dir, "checkpoint.save directory").acquire())
        except RunLocked:
            locks[0].release()
            raise
    return locks


def live_holder(directory: Path | str) -> dict | None:
    """The record of the live job holding ``directory``'s lock, or None when no live job holds it
    (no lock file, or a lock nobody holds: taken and dropped at once, so it is left as it was)."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd) or {"pid": None}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def stale_note(locks: list[RunLock]) -> list[str]:
    """One line per lock taken over from a holder that died without releasing it."""
    return [f"note: took over the lock of {lk.what} {lk.directory} from {_describe(lk.stale)}, "
            "which ended without releasing it" for lk in locks if lk.stale]
