"""Where data files are: the repository's bundled ``data/`` folder and user paths relative to it.

A relative path is looked up in the current directory first, then under the repository root, so
``data/shakespeare.jsonl`` works from a fresh clone whichever directory a run starts in.
"""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The checkout holding this package when it has a ``data/`` folder, else the current directory."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "data").is_dir() else Path.cwd()


def bundled(relative: str) -> Path:
    """A file shipped in the repository's ``data/`` folder.

    Raises:
        FileNotFoundError: the file is missing (e.g. paratron installed without its data folder).
    """
    p = repo_root() / "data" / relative
    if not p.is_file():
        raise FileNotFoundError(f"bundled data file {p} is missing; pass its path explicitly "
                                "(run from a paratron checkout, or set data.vocab_file/merge_file)")
    return p


def locate(path: str | os.PathLike) -> Path:
    """``path`` as given when it exists (as a file, folder or dataset prefix) or is absolute; else
    under the repository root if it exists there; else as given (relative to the current
    directory), for outputs."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists() or Path(f"{p}.idx").exists():
        return p
    alt = repo_root() / p
    return alt if alt.exists() or Path(f"{alt}.idx").exists() else p


def resolve_input(path: str | os.PathLike, field: str) -> Path:
    """An input file or directory that must exist; the error names the field.

    Raises:
        FileNotFoundError: it exists neither relative to the current directory nor the repo root.
    """
    p = locate(path)
    if not p.exists():
        raise FileNotFoundError(f"{field}={os.fspath(path)!r}: no such file (looked in {Path.cwd()} "
                                f"and {repo_root()})")
    return p
