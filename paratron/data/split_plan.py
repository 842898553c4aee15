"""Which documents of which prefix build each split (train, valid, test), and what a split too
small for one sample means: the one rule of every path that builds a dataset.

Every dataset path asks :func:`plan_splits`: one prefix or a weighted blend of fixed-length
samples (:func:`paratron.data.gpt_dataset.build_datasets`, each split its own blend), and the whole
documents of token-balanced microbatches (:func:`paratron.data.token_batches.document_splits`).
So does the check before launch (:func:`paratron.training.preflight.split_warnings`), so that a
split the ranks would refuse is refused before any process starts, and one they would skip is
reported once, on the launcher's console.

The rule, per split and prefix (a *part* of the split):

* one sample needs more than ``seq_length`` tokens (a window of ``seq_length + 1``), or with
  whole documents (``data.microbatch_tokens``) one document of at least 2 tokens (one position);
* a held-out part (valid, test) with too few tokens is left out of its split with a warning; its
  blend weight goes to the other prefixes, and a split with no part left is absent ("no valid
  dataset"); a part with no documents is left out too (a warning only in a blend: alone, a
  zero share of ``data.split`` asks for no such split);
* a train part with no documents is left out of a blend with a warning; a train part with
  documents but too few tokens, or a train split with no part left, is an error: the run cannot
  train on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")
RUN_SPLITS = (True, True, False)
"""The splits a training run reads: train and valid (the test split is never read)."""


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``/``-separated) -> three weights summing to 1 (missing ones are 0).

    Raises:
        ValueError: not up to three non-negative numbers with a positive sum (names ``split``).
    """
    try:
        vals = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(f"split={split!r} must be comma-separated numbers like '969,30,1'") from None
    if len(vals) > 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ValueError(f"split={split!r} must be up to 3 non-negative numbers with a positive sum")
    vals += [0.0] * (3 - len(vals))
    total = sum(vals)
    return [v / total for v in vals]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Contiguous document ranges ``[start, end)`` of train, valid and test.

    The bounds are the rounded cumulative shares of ``num_documents``; the last ends at
    ``num_documents``. E.g. 597 documents split ``969,30,1`` -> (0, 578), (578, 596), (596, 597).
    """
    weights = parse_split(split)
    bounds = [0]
    acc = 0.0
    for w in weights[:-1]:
        acc += w
        bounds.append(max(bounds[-1], min(num_documents, int(round(acc * num_documents)))))
    bounds.append(num_documents)
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


@dataclass(frozen=True)
class Part:
    """The documents ``documents`` (ids, int64 [n]) of one prefix's ``dataset`` in one split, and
    the prefix's blend weight (not normalised)."""

    weight: float
    dataset: object
    documents: np.ndarray


class SplitWarning(UserWarning):
    """A split, or one prefix's part of it, is left out (see the module docstring)."""


def holds_a_sample(lengths: np.ndarray, seq_length: int, whole_documents: bool = False) -> bool:
    """Whether documents of ``lengths`` tokens (int [n]) give at least one sample.

    Args:
        seq_length: tokens per sample input (a sample spans ``seq_length + 1`` tokens).
        whole_documents: token-balanced microbatches, whose samples are whole documents: one of at
            least 2 tokens is enough.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if whole_documents:
        return bool(np.any(lengths >= 2))
    return int(lengths.sum()) > seq_length


def _too_small(name: str, ds, docs: np.ndarray, seq_length: int, whole_documents: bool) -> str:
    need = "a document of at least 2 tokens" if whole_documents else f"more than {seq_length} tokens"
    held = int(ds.document_lengths[docs].sum()) if len(docs) else 0
    noun = "document" if len(docs) == 1 else "documents"
    return (f"{ds.prefix}: the {name} split ({len(docs)} {noun}, {held} tokens) has too few tokens for one "
            f"sample, which needs {need}")


def plan_splits(indexed: Sequence[tuple[float, object]], split: str, seq_length: int,
                whole_documents: bool = False, wanted: Sequence[bool] = (True, True, True),
                ) -> tuple[list[list[Part]], list[str]]:
    """The parts of each split under the rule of the module docstring, and its warnings.

    Args:
        indexed: ``[(weight, IndexedDataset), ...]``, one per prefix (several: a blend).
        split: ``"969,30,1"``-style shares of each prefix's documents
            (:func:`split_ranges`).
        seq_length: tokens per sample input.
        whole_documents: samples are whole documents (token-balanced microbatches).
        wanted: which of train, valid, test the caller builds; the others get no parts and no
            warnings.

    Returns:
        ``(parts, warnings)``: ``parts[s]`` lists the parts of split ``s`` (empty: no dataset);
        ``warnings`` one line each, naming the prefix and the split.

    Raises:
        ValueError: a train part with documents but too few tokens, or no train part at all
            (naming the prefix, the tokens and the rule).
    """
    blend = len(indexed) > 1
    out: list[list[Part]] = []
    notes: list[str] = []
    for s, name in enumerate(SPLIT_NAMES):
        parts: list[Part] = []
        for w, ds in indexed if wanted[s] else ():
            lo, hi = split_ranges(ds.num_documents, split)[s]
            docs = np.arange(lo, hi, dtype=np.int64)
            if holds_a_sample(ds.document_lengths[docs], seq_length, whole_documents):
                parts.append(Part(float(w), ds, docs))
            elif len(docs) and s == 0:
                raise ValueError(_too_small(name, ds, docs, seq_length, whole_documents) + "; the run cannot "
                                 "train on it (lower model.seq_length, or give the train split more documents "
                                 "with data.split)")
            elif len(docs):
                notes.append(_too_small(name, ds, docs, seq_length, whole_documents)
                             + ("; it is left out of the blend" if blend else f"; no {name} dataset"))
            elif blend:
                notes.append(f"{ds.prefix}: no {name} documents under data.split={split!r}; "
                             "it is left out of the blend")
        if wanted[s] and not parts and s == 0:
            raise ValueError(f"data.split={split!r}: no train documents in "
                             f"{', '.join(ds.prefix for _, ds in indexed)}; the run cannot train")
        if wanted[s] and not parts and blend:
            notes.append(f"no {name} dataset: none of the {len(indexed)} prefixes has a {name} split "
                         "large enough for one sample")
        out.append(parts)
    return out, notes
