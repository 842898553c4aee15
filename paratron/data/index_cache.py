"""Cache of a dataset's sample-index arrays as ``.npy`` files, reused only when parameters match.

A cache entry is named by a hash of a JSON *description* (every parameter the arrays depend on,
plus a fingerprint of the data) and holds that description beside the arrays. An entry is used only
when its stored description equals the requested one, so a changed seed, split, sequence length or
corpus builds new arrays instead of reusing stale ones. Arrays are written under temporary names
and renamed, description last: a reader never sees a partial entry, and processes that race build
the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np


def entry_stem(cache_dir: str | os.PathLike, label: str, description: dict) -> Path:
    """``cache_dir/<label>-<hash>``: the path stem of the entry for ``description``."""
    text = json.dumps(description, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    return Path(cache_dir) / f"{label}-{digest}"


def load_or_build(cache_dir: str | os.PathLike | None, label: str, description: dict,
                  build: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays for ``description``: memory-mapped from the cache when an equal entry exists,
    else ``build()``-ed and saved (when ``cache_dir`` is not None).

    Args:
        cache_dir: directory of the cache (created if needed); None disables caching.
        label: readable part of the file names.
        description: JSON-serialisable parameters of the arrays.
        build: makes the arrays, by name.
    """
    if cache_dir is None:
        return build()
    stem = entry_stem(cache_dir, label, description)
    desc_path = Path(f"{stem}-description.json")
    if desc_path.is_file():
        try:
            stored = json.loads(desc_path.read_text())
        except (OSError, json.JSONDecodeError):
            stored = None
        if stored is not None and stored.get("description") == json.loads(json.dumps(description)):
            try:
                return {name: np.load(f"{stem}-{name}.npy", mmap_mode="r", allow_pickle=False)
                        for name in stored["arrays"]}
            except (OSError, ValueError):
                pass  # a damaged entry is rebuilt below
    arrays = build()
    stem.parent.mkdir(parents=True, exist_ok=True)
    tag = f".tmp{os.getpid()}"
    for name, arr in arrays.items():
        tmp = f"{stem}-{name}.npy{tag}"
        with open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
        os.replace(tmp, f"{stem}-{name}.npy")
    tmp = f"{desc_path}{tag}"
    Path(tmp).write_text(json.dumps({"description": description, "arrays": sorted(arrays)}, indent=1,
                                    sort_keys=True))
    os.replace(tmp, desc_path)
    return arrays
