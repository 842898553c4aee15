"""The file system under a checkpoint root: writable, enough free space, no stale temporaries.

Checked before training starts (``training.preflight``) and again before each save, so that a
read-only or full disk is reported at once, with the directory and the bytes, instead of by the
final save after the whole run's training. A save that still runs out of space is reported as such
(:func:`no_space_message`) and its partial directory removed.

Temporary directories are named ``tmp.step_<N>.<pid>`` (and ``step_<N>.<pid>`` while an existing
step is being replaced) by the writer whose rank 0 has that pid; :func:`remove_stale_temporaries`
deletes those whose writer is no longer alive on this host. One writer per root is assumed (the
launcher's lock).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from .items import CheckpointError

TEMPORARY = re.compile(r"^(?:tmp\.step_\d+|step_\d+)\.(\d+)$")


class OutOfSpaceError(CheckpointError):
    """Not enough free space for a checkpoint; the message names the directory and both byte counts."""


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(directory: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still use on the file system of ``directory`` (or of its
    nearest existing parent, when it does not exist yet)."""
    st = os.statvfs(_existing_ancestor(Path(directory)))
    return int(st.f_bavail) * int(st.f_frsize)


def no_space_message(directory: str | os.PathLike, needed: int, free: int) -> str:
    return (f"no space left on device for a checkpoint in {os.fspath(directory)}: it needs about "
            f"{needed:,} bytes, {free:,} bytes are free; free some space or set checkpoint.save "
            "to another disk")


def check_space(directory: str | os.PathLike, needed: int) -> None:
    """Refuse a write of ``needed`` bytes into ``directory`` when the disk has less free.

    Raises:
        OutOfSpaceError: naming the directory, the bytes needed and the bytes free.
    """
    free = free_bytes(directory)
    if free < needed:
        raise OutOfSpaceError(no_space_message(directory, needed, free))


def check_writable(directory: str | os.PathLike) -> None:
    """Create ``directory`` if needed and write, then delete, a probe file in it.

    A real write rather than ``os.access``: that answers yes for root on a read-only bind mount
    and says nothing about quotas.

    Raises:
        CheckpointError: the directory cannot be created or written (with the OS's reason).
    """
    directory = Path(directory)
    probe = directory / f".paratron-write-probe.{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {directory} is not writable: "
                              f"{e.strerror or e} (errno {e.errno})") from None


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it wraps) is the OS saying the disk or quota is full."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_stale_temporaries(root: str | os.PathLike) -> list[Path]:
    """Delete the temporary save directories under ``root`` whose writer process is dead (never
    the one ``latest`` names: a crash while replacing a step can leave ``latest`` on it).

    Returns:
        The directories removed.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    latest = root / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    removed = []
    for p in sorted(root.iterdir()):
        m = TEMPORARY.match(p.name)
        if (m and p.is_dir() and p.name != named and int(m.group(1)) != os.getpid()
                and not _alive(int(m.group(1)))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed
