"""Reading a corpus: JSONL (one JSON object a line) or plain text, with errors that name the file
and line.

Reading is split in two so that worker processes can do the expensive part: :func:`chunks` cuts
the input into raw-byte chunks in the main process (cheap, sequential), and :func:`parse_chunk`
decodes and parses one chunk wherever it runs, returning the texts and the bad lines it found.
A ``.jsonl``/``.json``/``.ndjson`` file holds one document a line; any other file is one document.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
"""A directory given as input contributes its files with these suffixes (and JSONL_SUFFIXES);
other files in it (an index, a README without suffix, hidden files) are not corpus text."""


class BadInputError(ValueError):
    """A line of the input cannot be read; the message is ``FILE:LINE: reason``."""


@dataclass
class Chunk:
    """Raw lines of one file: ``lines[i]`` is line ``first_line + i`` (1-based), newline included.

    ``jsonl`` False means the chunk is a whole text file (one document).
    """
    path: str
    first_line: int
    lines: list[bytes]
    jsonl: bool
    seq: int = 0

    @property
    def nbytes(self) -> int:
        return sum(len(x) for x in self.lines)


@dataclass
class Parsed:
    """What :func:`parse_chunk` found: ``texts[k]`` lists one text per document for key ``k``."""
    texts: list[list[str]]
    bad: list[str] = field(default_factory=list)


def input_files(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand the ``--input`` arguments: files as given, directories to their JSONL and text files
    (:data:`JSONL_SUFFIXES`, :data:`TEXT_SUFFIXES`; sorted, hidden ones skipped).

    Raises:
        FileNotFoundError: an input that does not exist (named).
    """
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".")
                              and f.suffix.lower() in JSONL_SUFFIXES + TEXT_SUFFIXES))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"--input {os.fspath(item)}: no such file or directory")
    if not out:
        raise FileNotFoundError(f"--input {' '.join(map(str, inputs))}: no files found")
    return out


def is_jsonl(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() in JSONL_SUFFIXES


def chunks(files: Sequence[Path], chunk_bytes: int = 1 << 18) -> Iterator[Chunk]:
    """Cut the files into chunks of about ``chunk_bytes`` (whole lines; a text file whole)."""
    seq = 0
    for path in files:
        if not is_jsonl(path):
            yield Chunk(str(path), 1, [path.read_bytes()], jsonl=False, seq=seq)
            seq += 1
            continue
        with open(path, "rb") as f:
            lines: list[bytes] = []
            size, first = 0, 1
            for lineno, raw in enumerate(f, start=1):
                lines.append(raw)
                size += len(raw)
                if size >= chunk_bytes:
                    yield Chunk(str(path), first, lines, jsonl=True, seq=seq)
                    seq += 1
                    lines, size, first = [], 0, lineno + 1
            if lines:
                yield Chunk(str(path), first, lines, jsonl=True, seq=seq)
                seq += 1


def _decode(raw: bytes, path: str, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        # For a whole text file, turn the byte offset into a line and column.
        before = raw[:e.start]
        line += before.count(b"\n")
        col = e.start - (before.rfind(b"\n") + 1) + 1
        raise BadInputError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {col})") from None


def _excerpt(text: str, limit: int = 80) -> str:
    """The record as written, cut to ``limit`` characters, for error messages."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_line(raw: bytes, path: str, line: int, keys: Sequence[str]) -> list[str]:
    """The texts under ``keys`` of one JSONL line.

    Raises:
        BadInputError: non-UTF-8 bytes, malformed JSON, not an object, a missing key, or a
            non-string value; the message is ``path:line: reason``.
    """
    text = _decode(raw, path, line)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInputError(f"{path}:{line}: malformed JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadInputError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
    out = []
    for k in keys:
        if k not in obj:
            raise BadInputError(f"{path}:{line}: missing key {k!r} (keys: {', '.join(map(repr, obj))}) "
                                f"in record {_excerpt(text)}")
        v = obj[k]
        if not isinstance(v, str):
            raise BadInputError(f"{path}:{line}: key {k!r} holds {type(v).__name__}, not a string")
        out.append(v)
    return out


def parse_chunk(chunk: Chunk, keys: Sequence[str]) -> Parsed:
    """Decode and parse a chunk; bad lines are collected (in order), not raised. Blank JSONL lines
    are skipped silently, as JSONL readers do."""
    got = Parsed(texts=[[] for _ in keys])
    if not chunk.jsonl:
        try:
            text = _decode(chunk.lines[0], chunk.path, 1)
        except BadInputError as e:
            got.bad.append(str(e))
            return got
        for k in range(len(keys)):
            got.texts[k].append(text)
        return got
    for i, raw in enumerate(chunk.lines):
        if not raw.strip():
            continue
        try:
            values = parse_line(raw, chunk.path, chunk.first_line + i, keys)
        except BadInputError as e:
            got.bad.append(str(e))
            continue
        for k, v in enumerate(values):
            got.texts[k].append(v)
    return got


def iter_documents(inputs: Sequence[str | os.PathLike], key: str = "text",
                   skip_bad_lines: bool = False) -> Iterator[str]:
    """Every document's text, in order, in one process (used to train a tokenizer).

    Raises:
        BadInputError: the first bad line, unless ``skip_bad_lines``.
    """
    for chunk in chunks(input_files(inputs)):
        got = parse_chunk(chunk, [key])
        if got.bad and not skip_bad_lines:
            raise BadInputError(got.bad[0])
        yield from got.texts[0]
