"""The progress bar of paratron's long commands: tqdm on a terminal, nothing in logs.

A bar is drawn on stderr only when stderr is a terminal and the command was not asked to be
quiet (``--quiet``); otherwise the bar is tqdm's disabled one, whose methods do nothing, so the
calling code is the same either way::

    with progress_bar(len(items), "simulate", quiet=args.quiet) as bar:
        for item in items:
            ...
            bar.update()
"""

from __future__ import annotations

import sys
from typing import Any, TextIO


def shows(quiet: bool = False, stream: TextIO | None = None) -> bool:
    """True when a bar would be drawn: not ``quiet`` and ``stream`` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not quiet and callable(isatty) and bool(isatty())


def progress_bar(total: float | None = None, desc: str = "", *, quiet: bool = False, **tqdm_kwargs: Any):
    """A ``tqdm`` bar on stderr (``total`` steps, or an iterable as ``iterable=``), disabled unless
    :func:`shows`; extra keyword arguments go to ``tqdm`` (``unit="B", unit_scale=True``, ...)."""
    from tqdm import tqdm

    tqdm_kwargs.setdefault("dynamic_ncols", True)
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not shows(quiet), **tqdm_kwargs)
