"""Hugging Face ``datasets`` input (``data.hf_dataset = PATH_OR_NAME``), random access or streamed.

``data.hf_dataset`` names a local file (``.parquet``, ``.arrow``, ``.json``/``.jsonl``/``.ndjson``),
a folder of such files, a folder written by ``Dataset.save_to_disk``, or a dataset name the
``datasets`` library resolves (its cache; a run has no network of its own). ``data.hf_split``
picks the split (``"train"``; a single file has only that one). Records are text
(``data.text_key``, the same field as ``data.json_key``) or, with ``data.format = "chat"``,
conversations (``data.messages_key``): :mod:`paratron.data.records` tokenises them.

``data.streaming = false`` loads the split as an Arrow table (memory-mapped) and reads rows by
index: ``data.split`` cuts it into train and validation rows as for an indexed corpus, and
:class:`~paratron.data.sampler.PretrainingSampler` orders each epoch, so a resume at
``consumed_train_samples`` reads exactly what an uninterrupted run would.

``data.streaming = true`` reads the split as an ``IterableDataset``: the files are opened and
read in order as the run gets to them, never loaded whole. Record ``c`` of the run is the
``c mod N``-th of a pass (``N`` rows; pass ``c div N``), in the dataset's own order (no shuffle:
a shuffle buffer would make the order depend on where a run started). The data position is
``consumed_train_samples``, checkpointed with every save like any run's, and every resume seeks
from it anew (:meth:`StreamRecords.seek`), so a second resume continues from the second save and
a pass boundary is just a position; the pass length, once a run has seen the end, is
checkpointed too (:meth:`StreamRecords.state_dict`) so that a resume reads only the current pass
up to its position. There is no validation split in streaming mode.
"""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

from paratron.data.paths import locate
from paratron.data.sampler import STREAM_LENGTH

BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".ndjson": "json"}
"""File suffix -> the ``datasets`` packaged builder that reads it."""


def require_datasets():
    """The ``datasets`` module, or an ImportError naming the ``paratron[hf]`` extra."""
    try:
        import datasets
    except ImportError:
        raise ImportError("data.hf_dataset reads with the Hugging Face datasets library, which is not "
                          "installed: pip install 'paratron[hf]' (or pip install datasets)") from None
    return datasets


def _files_builder(path: Path) -> tuple[str, list[str]] | None:
    """``(builder, data files)`` of a data file or a folder of them; None for anything else."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in BUILDERS
                                                 and not p.name.startswith("."))
    kinds = {BUILDERS.get(p.suffix) for p in files}
    if not files or None in kinds:
        return None
    if len(kinds) > 1:
        raise ValueError(f"data.hf_dataset={str(path)!r} mixes file kinds ({sorted(kinds)}); use one")
    return kinds.pop(), [str(p) for p in files]


def load(data_cfg, streaming: bool | None = None):
    """The ``data.hf_split`` split of ``data.hf_dataset``: a ``datasets.Dataset``, or an
    ``IterableDataset`` when streaming.

    Raises:
        ImportError: ``datasets`` missing (names the extra).
        ValueError: a split the dataset lacks (names it and the splits there), mixed file kinds.
    """
    datasets = require_datasets()
    streaming = data_cfg.streaming if streaming is None else streaming
    name, split = data_cfg.hf_dataset, data_cfg.hf_split
    path = locate(name)
    if path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"data.hf_split={split!r}: {name} has splits {sorted(ds)}")
            ds = ds[split]
        return ds.to_iterable_dataset() if streaming else ds
    found = _files_builder(path) if path.exists() else None
    args = (found[0],) if found else (name,)
    kwargs = {"data_files": found[1]} if found else {}
    try:
        return datasets.load_dataset(*args, split=split, streaming=streaming, cache_dir=data_cfg.cache_dir, **kwargs)
    except ValueError as e:
        if "split" in str(e).lower():
            raise ValueError(f"data.hf_split={split!r} of data.hf_dataset={name!r}: {e}") from None
        raise


class StreamRecords:
    """The records of a streamed dataset by run position (see the module docstring).

    Args:
        open_pass: ``epoch -> iterator`` over one pass of the dataset's records.
        pass_length: rows per pass when known (from a checkpoint), else learnt at the first end.

    Reading is sequential: asking for a position at or after the cursor reads on to it (the
    records between are read and dropped, never tokenised); asking for an earlier one seeks.
    """

    def __init__(self, open_pass: Callable[[int], Iterator[Any]], pass_length: int | None = None):
        self.open_pass, self.pass_length = open_pass, pass_length
        self._it: Iterator[Any] | None = None
        self._epoch = self._offset = self._cursor = 0
        self.records_read = 0
        """Records pulled from the dataset (skipped ones included): what a seek cost."""

    def __len__(self) -> int:
        return STREAM_LENGTH

    def seek(self, pos: int) -> None:
        """Put the cursor at run position ``pos``: the pass it falls in when the pass length is
        known (reading only that pass up to it), else the first pass (reading on from there)."""
        epoch, offset = divmod(pos, self.pass_length) if self.pass_length else (0, 0)
        self._epoch, self._offset = epoch, 0
        self._cursor = pos - offset if self.pass_length else 0  # unknown length: read on from the start
        self._it = self.open_pass(epoch)
        for _ in islice(self._it, offset):
            self.records_read += 1
            self._offset += 1
            self._cursor += 1

    def _next(self) -> Any:
        try:
            record = next(self._it)
        except StopIteration:
            if self._offset == 0:
                raise ValueError("data.hf_dataset: the streamed split holds no record") from None
            self.pass_length, self._epoch, self._offset = self._offset, self._epoch + 1, 0
            self._it = self.open_pass(self._epoch)
            record = next(self._it)
        self.records_read += 1
        self._offset += 1
        self._cursor += 1
        return record

    def record(self, pos: int) -> Any:
        """The record at run position ``pos``."""
        if self._it is None or pos < self._cursor:
            self.seek(pos)
        while self._cursor < pos:
            self._next()
        return self._next()

    def row_id(self, pos: int) -> list[int]:
        """``[pass, row]`` of a position already read (the row within its pass)."""
        if self.pass_length:
            return list(divmod(int(pos), self.pass_length))
        return [0, int(pos)]  # no end seen yet: every position read so far is in the first pass

    def state_dict(self) -> dict:
        return {"hf_stream_pass_length": self.pass_length}

    def load_state_dict(self, state: dict) -> None:
        n = state.get("hf_stream_pass_length")
        if n:
            self.pass_length = int(n)
            self._it = None  # the next read seeks with it


def stream_records(dataset) -> StreamRecords:
    """:class:`StreamRecords` over an ``IterableDataset`` (a new iterator per pass; ``set_epoch``
    keeps a shuffled dataset's passes distinct)."""
    def open_pass(epoch: int):
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        return iter(dataset)

    return StreamRecords(open_pass)
