"""Documents tokenised on demand from records (chat conversations, Hugging Face dataset rows),
each with a loss mask, read by stream position.

This is the data path of ``data.format = "chat"`` and ``data.hf_dataset``: a document is one
record, rendered to ``tokens`` int64 ``[L]`` and ``mask`` bool ``[L]`` (True where the token is a
loss target: every token of a text record; the assistant's of a conversation). Two ways to read
them, the same as for indexed corpora:

fixed-length rows (``data.microbatch_tokens`` unset)
    sample ``i`` is document ``i`` alone: inputs ``tokens[:s]``, labels ``tokens[1:s + 1]``
    (``s = model.seq_length``; longer documents are cut there) ignored (-100) where the mask is
    False, padded to ``s`` with ignored labels. The sampler is
    :class:`~paratron.data.sampler.PretrainingSampler`, so the position to resume at is
    ``consumed_train_samples`` alone.
token-balanced packed rows (``data.microbatch_tokens``)
    the documents go to :class:`~paratron.data.token_batches.TokenBudgetSampler` through
    :attr:`TokenisedDocuments.lengths`; :func:`~paratron.data.token_batches.collate_pieces`
    applies the mask through :meth:`TokenisedDocuments.read_mask`.

Either way a label is a target only where the mask says so, and the training step divides the
loss sum by the global count of target labels (:func:`paratron.training.step.run_global_batch`):
the loss is the mean over the assistant tokens of the whole global batch.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np
import torch

from paratron.data import hf_datasets
from paratron.data.chat import build_renderer, conversation, read_jsonl
from paratron.data.paths import resolve_input
from paratron.data.sampler import STREAM_LENGTH, PretrainingSampler
from paratron.data.split_plan import split_ranges

IGNORE_INDEX = -100



class RowRange:
    """Rows ``lo .. hi - 1`` of a random-access dataset, as records ``0 .. hi - lo - 1``
    (a train or validation split of ``data.split``). ``row_id(i)`` is the dataset row."""

    def __init__(self, rows, lo: int, hi: int):
        self.rows, self.lo, self.hi = rows, int(lo), int(hi)

    def __len__(self) -> int:
        return self.hi - self.lo

    def record(self, i: int) -> Any:
        return self.rows[self.lo + int(i)]

    def row_id(self, i: int) -> list[int]:
        """``[epoch, row]``: random-access records have no epoch of their own (0)."""
        return [0, self.lo + int(i)]

    def where(self, i: int) -> str:
        """The record's place for error messages: ``FILE:LINE`` of a JSONL file, else its row."""
        place = getattr(self.rows, "where", None)
        return place(self.lo + int(i)) if place else f"data.hf_dataset row {self.lo + int(i)}"


class LazyLengths:
    """``lengths[i]``: tokens of document ``i``, tokenising it on first use."""

    def __init__(self, docs: "TokenisedDocuments"):
        self.docs = docs

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i) -> int:
        return len(self.docs.document(int(i))[0])


class TokenisedDocuments:
    """Records tokenised on demand, with a bounded cache.

    Args:
        records: ``len()``, ``record(i)``, ``row_id(i)`` (:class:`RowRange` or
            :class:`paratron.data.hf_datasets.StreamRecords`).
        tokenise: ``(record, where) -> (tokens int64 [L], mask bool [L])``.
        seq_length: positions of a fixed-length row.
        pad_id: the token id of padding.
        cache_size: documents kept tokenised (at least two global batches, so a step never
            tokenises a document twice).
    """

    def __init__(self, records, tokenise: Callable, seq_length: int, pad_id: int, cache_size: int = 4096):
        self.records, self.tokenise = records, tokenise
        self.seq_length, self.pad_id, self.cache_size = seq_length, pad_id, cache_size
        self._cache: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.lengths = LazyLengths(self)

    def __len__(self) -> int:
        return len(self.records)

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, mask)`` of document ``i``."""
        if i in self._cache:
            self._cache.move_to_end(i)
            return self._cache[i]
        record = self.records.record(i)
        doc = self.tokenise(record, self.describe(i))
        self._cache[i] = doc
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return doc

    def describe(self, i: int) -> str:
        place = getattr(self.records, "where", None)
        if place:
            return place(i)
        epoch, row = self.records.row_id(i)
        return f"data.hf_dataset row {row} (pass {epoch})"

    def sample_id(self, i: int) -> list[int]:
        """``[epoch, row]`` of document ``i``: the record's row in its dataset, and for a stream the
        pass over it (random access: 0)."""
        return self.records.row_id(i)

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop - 1`` of document ``doc`` (the ``read`` of
        :func:`~paratron.data.token_batches.collate_pieces`)."""
        return self.document(doc)[0][start:stop]

    def read_mask(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Loss-target flags of tokens ``start .. stop - 1`` of document ``doc``."""
        return self.document(doc)[1][start:stop]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Fixed-length sample ``i``: ``tokens`` and ``labels`` int64 ``[s]`` (see the module docstring)."""
        return fixed_row(*self.document(int(i)), self.seq_length, self.pad_id)


def fixed_row(tokens: np.ndarray, mask: np.ndarray, seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One document as a row of ``seq_length`` positions: inputs ``tokens[:s]``, labels
    ``tokens[1:s + 1]`` where ``mask`` is True (else -100), padded with ``pad_id`` / -100."""
    s = seq_length
    inputs = tokens[:s]
    labels = np.where(mask[1:s + 1], tokens[1:s + 1], IGNORE_INDEX)
    out_t = np.full(s, pad_id, dtype=np.int64)
    out_l = np.full(s, IGNORE_INDEX, dtype=np.int64)
    out_t[:len(inputs)] = inputs
    out_l[:len(labels)] = labels
    return {"tokens": torch.from_numpy(out_t), "labels": torch.from_numpy(out_l)}


class PositionSampler(PretrainingSampler):
    """A :class:`~paratron.data.sampler.PretrainingSampler` whose stream is the positions
    themselves (``stream(c, n) = c .. c + n - 1``): a streamed dataset is read in its own order,
    and position ``c`` is its ``c``-th record, counting on through later passes. The global batch
    and DP layout of a step are the parent's."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_rank: int = 0,
                 data_parallel_size: int = 1):
        super().__init__(STREAM_LENGTH, global_batch_size, micro_batch_size, data_parallel_rank,
                         data_parallel_size, shuffle=False)

    def stream(self, start: int, count: int) -> np.ndarray:
        if start < 0:
            raise ValueError(f"consumed_samples={start} must be >= 0")
        return np.arange(start, start + count, dtype=np.int64)


def text_tokeniser(tok, text_key: str) -> Callable:
    """``(record, where) -> (tokens, mask)`` of a text record: ``record[text_key]`` tokenised,
    the end-of-document token appended, every token a target.

    Raises:
        ValueError: no string ``text_key`` in the record (names ``where`` and the keys).
    """
    def tokenise(record, where: str):
        text = record.get(text_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: no string {text_key!r} field (data.text_key / data.json_key); found {keys}")
        ids = np.asarray(tok.encode(text) + [tok.eod], dtype=np.int64)
        return ids, np.ones(len(ids), dtype=bool)

    return tokenise


def chat_tokeniser(renderer, messages_key: str) -> Callable:
    """``(record, where) -> (tokens, mask)`` of a conversation (:mod:`paratron.data.chat`)."""
    def tokenise(record, where: str):
        return renderer(conversation(record, messages_key, where), where)

    return tokenise


class JsonlRows:
    """The records of a JSONL file by row, each with its ``FILE:LINE``."""

    def __init__(self, path):
            self.places, self.rows = zip(*read_jsonl(path))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Any:
        return self.rows[i]

    def where(self, i: int) -> str:
        return self.places[i]


def record_tokeniser(data_cfg, tok) -> tuple[Callable, str]:
    """``(tokenise, description)`` of a run's records: conversations with the chat template
    (``data.format = "chat"``), else text records of ``data.json_key``."""
    if data_cfg.format == "chat":
        renderer, desc = build_renderer(data_cfg, tok)
        return chat_tokeniser(renderer, data_cfg.messages_key), f"chat records, template {desc}"
    return text_tokeniser(tok, data_cfg.json_key), f"text records ({data_cfg.json_key!r})"


def record_splits(data_cfg, tok, seq_length: int, cache_size: int = 4096
                  ) -> tuple[TokenisedDocuments, TokenisedDocuments | None, str]:
    """The train and validation documents of a record-based run, and a description for the log.

    A chat JSONL file (``data.corpus``) or a random-access ``data.hf_dataset`` is cut by
    ``data.split`` into contiguous train / validation rows (None when empty); a streamed one is
    all training (:mod:`paratron.data.hf_datasets`).
    """
    tokenise, desc = record_tokeniser(data_cfg, tok)

    def docs(records):
        return TokenisedDocuments(records, tokenise, seq_length, tok.eod, cache_size)

    if data_cfg.hf_dataset and data_cfg.streaming:
        return docs(hf_datasets.stream_records(hf_datasets.load(data_cfg))), None, \
            f"{desc} streamed from {data_cfg.hf_dataset}"
    if data_cfg.hf_dataset:
        rows, source = hf_datasets.load(data_cfg), data_cfg.hf_dataset
    else:
        rows = JsonlRows(resolve_input(data_cfg.corpus, "data.corpus"))
        source = data_cfg.corpus
    (lo, hi), (vlo, vhi) = split_ranges(len(rows), data_cfg.split)[:2]
    if hi == lo:  # the rule of paratron.data.split_plan: a run cannot train on an empty split
        raise ValueError(f"{source}: data.split={data_cfg.split!r} leaves no training record of {len(rows)}")
    valid = docs(RowRange(rows, vlo, vhi)) if vhi > vlo else None
    return docs(RowRange(rows, lo, hi)), valid, f"{desc} from {source} ({hi - lo} train, {vhi - vlo} valid rows)"


def check_records(data_cfg, tok, seq_length: int, limit: int = 100) -> str:
    """Load a record-based run's data and tokenise its first ``limit`` training records (every
    one of a chat JSONL file), so that a bad record stops the run before launch; returns the
    description of :func:`record_splits`.

    Raises:
        ChatFormatError, ValueError: a bad record (``FILE:LINE`` or its row, and the rule).
        ImportError: ``datasets`` / ``jinja2`` missing (names ``paratron[hf]``).
    """
    train, _, desc = record_splits(data_cfg, tok, seq_length, cache_size=1)
    count = len(train) if not data_cfg.hf_dataset else min(limit, len(train))
    for i in range(count):
        train.document(i)
    return desc


def first_prompt(data_cfg, tok, docs: TokenisedDocuments | None) -> str | None:
    """A sample prompt from the data: the first record's conversation up to its first assistant
    turn, rendered with the generation prompt (chat), or its first 8 tokens (text). None for no
    record, and for a stream (reading it would move the reader)."""
    if docs is None or len(docs) == 0 or data_cfg.streaming:
        return None
    record = docs.records.record(0)
    if data_cfg.format != "chat":
        return tok.decode(docs.document(0)[0][:8].tolist())
    messages = conversation(record, data_cfg.messages_key, docs.describe(0))
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return build_renderer(data_cfg, tok)[0].render(messages[:first], add_generation_prompt=True)
