"""Which tokenizer built a ``.bin``/``.idx`` pair: a small ``PREFIX.meta.json`` beside it.

Megatron's index format does not say which tokenizer produced the ids, so training on ids of one
tokenizer with the embedding and decoder of another runs without error and learns nothing useful.
Every dataset paratron writes carries this record::

    {"format": "paratron-dataset-meta", "tokenizer": {"kind", "name", "source", "fingerprint",
     "vocab_size", "eod"}, "source": {"files": [...], "content_hash": "..."}, "json_keys": [...]}

and :func:`check_tokenizer` refuses a run whose configured tokenizer has another fingerprint,
naming both. Datasets written by other tools have no record and are not checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

FORMAT = "paratron-dataset-meta"


class TokenizerMismatchError(ValueError):
    """A dataset was built by another tokenizer than the one the run is configured with."""


def record_path(prefix: str | os.PathLike) -> Path:
    """``PREFIX.meta.json``."""
    return Path(f"{os.fspath(prefix)}.meta.json")


def tokenizer_record(tok) -> dict[str, Any]:
    """The plain-JSON description of a :class:`paratron.data.tokenizer.Tokenizer`."""
    return {"kind": tok.kind, "name": tok.name, "source": tok.source, "fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size, "eod": tok.eod}


def write_record(prefix: str | os.PathLike, tok, *, json_keys=None, source: Optional[dict] = None) -> None:
    """Write ``PREFIX.meta.json`` atomically (temporary file, then rename)."""
    path = record_path(prefix)
    body = {"format": FORMAT, "tokenizer": tokenizer_record(tok), "json_keys": list(json_keys or []),
            "source": source or {}}
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_record(prefix: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The record of ``prefix``, or None when it has none (written by another tool).

    Raises:
        ValueError: the record exists but is not valid (names the file).
    """
    path = record_path(prefix)
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable dataset record ({e}); delete it, or rebuild the dataset") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or "tokenizer" not in body:
        raise ValueError(f"{path}: not a {FORMAT} record")
    return body


def describe_record(tok: dict[str, Any]) -> str:
    """A tokenizer record as one phrase, like ``Tokenizer.describe``."""
    where = f" ({tok.get('source')})" if tok.get("source") else ""
    return (f"{tok.get('kind')} {tok.get('name')}{where}, vocab {tok.get('vocab_size')}, "
            f"fingerprint {tok.get('fingerprint')}")


def check_tokenizer(prefix: str | os.PathLike, tok) -> None:
    """Refuse ``prefix`` when its record names another tokenizer than ``tok``.

    Raises:
        TokenizerMismatchError: the fingerprints differ; the message names both tokenizers.
    """
    body = read_record(prefix)
    if body is None:
        return
    built = body["tokenizer"]
    if built.get("fingerprint") != tok.fingerprint:
        raise TokenizerMismatchError(
            f"{os.fspath(prefix)}.bin/.idx were built with {describe_record(built)}, but this run's "
            f"tokenizer is {tok.describe()}; set data.tokenizer_type (and data.tokenizer_model or "
            "data.vocab_file) to the tokenizer that built the data, or rebuild the data with this one")
