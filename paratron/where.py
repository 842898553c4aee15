"""Whether a source file is part of the paratron package, judged by its real location.

Frames are attributed to paratron (the device audit's host syncs, the failure summary's
``file:line``) by where the imported package lives, never by ``"paratron"`` appearing in a path:
a clone in a folder named ``paratron`` with its ``.venv`` inside puts torch's own files under
``.../paratron/.venv/...``, and a path test would call them paratron's.
"""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
"""The directory of the imported ``paratron`` package, symlinks resolved."""


def package_relpath(filename: str) -> str | None:
    """``filename`` relative to :data:`PACKAGE_DIR` (e.g. ``"optim/optimizer.py"``) when the file
    is inside the paratron package, else None."""
    real = os.path.realpath(filename)
    if real.startswith(PACKAGE_DIR + os.sep):
        return os.path.relpath(real, PACKAGE_DIR)
    return None
