"""GPT pretraining samples: fixed-length token windows drawn across document boundaries.

Three index arrays, all built from a seed, in the scheme of Megatron-LM's
``megatron/core/datasets/gpt_dataset.py`` (the code accompanying Shoeybi et al. 2019) with two
changes: each epoch's documents are shuffled separately (Megatron shuffles all but a short last
epoch together), and the sample index is computed by one vectorised search instead of a C++ loop:

document index
    the split's documents repeated for as many epochs as the requested samples need, each epoch
    in its own shuffled order, so epoch ``e`` is used up before epoch ``e + 1`` begins;
sample index [num_samples + 1, 2]
    (position in the document index, token offset) where each sample starts; sample ``i`` is the
    ``seq_length + 1`` tokens from its start through the next sample's start, inclusive (so
    consecutive samples share one token and no token is skipped);
shuffle index [num_samples]
    a permutation of the samples, shuffled within each epoch's block of samples.

Token positions are computed in int64; the stored arrays are int32 when their values fit and int64
when they can pass 2^31. The arrays are cached (:mod:`paratron.data.index_cache`) next to the data
(``<data dir>/cache/``) or in ``cache_dir``, and reused only when every parameter matches.
"""

from __future__ import annotations

import math
import os
import warnings
import zlib
from typing import Optional, Sequence

import numpy as np
import torch

from paratron.data import index_cache
from paratron.data.blending import BlendedDataset
from paratron.data.indexed import IndexedDataset
from paratron.data.split_plan import SPLIT_NAMES, SplitWarning, parse_split, plan_splits, split_ranges

__all__ = ["GPTDataset", "SPLIT_NAMES", "build_datasets", "parse_split", "split_ranges"]

INDEX_VERSION = 1
"""Bumped when the way indices are built changes, so old cache entries stop matching."""

def index_dtype(max_value: int) -> type:
    """int32 when every value is below 2^31, else int64."""
    return np.int32 if max_value < 2**31 else np.int64


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.Generator) -> np.ndarray:
    """``num_epochs`` shuffled copies of ``documents``, concatenated: [num_epochs * len(documents)]."""
    dt = index_dtype(int(documents.max(initial=0)) + 1)
    return np.concatenate([rng.permutation(documents).astype(dt) for _ in range(num_epochs)]) \
        if num_epochs else np.zeros(0, dt)


def build_sample_index(doc_lengths: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """Start (document-index position, offset) of samples ``0..num_samples``: [num_samples + 1, 2].

    Args:
        doc_lengths: tokens of each entry of the document index, in order, [n].
        seq_length: tokens per sample input; a sample spans ``seq_length + 1`` tokens.
        num_samples: samples wanted; the documents must hold ``num_samples * seq_length + 1`` tokens.

    Raises:
        ValueError: too few tokens.
    """
    ends = np.cumsum(doc_lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if total < num_samples * seq_length + 1:
        raise ValueError(f"{num_samples} samples of {seq_length} + 1 tokens need "
                         f"{num_samples * seq_length + 1} tokens; the document index has {total}")
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")  # skips empty documents too
    offset = starts - (ends[pos] - np.asarray(doc_lengths, dtype=np.int64)[pos])
    dt = index_dtype(max(len(ends), int(np.max(doc_lengths, initial=0))))
    return np.stack([pos, offset], axis=1).astype(dt)


def build_shuffle_index(sample_epochs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``range(len(sample_epochs))`` that shuffles within each epoch's block.

    Args:
        sample_epochs: the (non-decreasing) epoch of each sample, [num_samples].
    """
    n = len(sample_epochs)
    out = np.arange(n, dtype=index_dtype(n))
    cuts = np.flatnonzero(np.diff(sample_epochs)) + 1
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, n]):
        rng.shuffle(out[lo:hi])
    return out


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens from documents ``documents`` of an indexed dataset.

    ``ds[i]`` is ``{"tokens": LongTensor [seq_length], "labels": LongTensor [seq_length]}``, labels
    being the tokens shifted left by one. ``len(ds)`` is every sample of the epochs built: at least
    ``num_samples`` (or one epoch's worth when ``num_samples`` is None).

    Args:
        indexed: the token file.
        documents: document ids of this split, [n] (e.g. ``np.arange(start, end)``).
        seq_length: tokens per sample input.
        num_samples: samples needed (sets the number of epochs); None means one epoch.
        seed: seeds the document and shuffle orders (mixed with ``name``).
        name: the split's name, part of the cache key and the seed.
        cache_dir: index cache directory; None means ``<dir of the prefix>/cache``; ``False``
            disables caching.

    Raises:
        ValueError: seq_length < 1, or no tokens in the split while samples are wanted.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, seq_length: int,
                 num_samples: Optional[int], seed: int, name: str = "train",
                 cache_dir: str | os.PathLike | None | bool = None):
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        self.indexed, self.seq_length, self.name = indexed, int(seq_length), name
        documents = np.asarray(documents, dtype=np.int64)
        tokens_per_epoch = int(indexed.document_lengths[documents].sum(dtype=np.int64))
        if tokens_per_epoch <= seq_length:
            raise ValueError(f"{indexed.prefix} ({name}): {len(documents)} documents hold "
                             f"{tokens_per_epoch} tokens, too few for one sample of {seq_length} + 1")
        wanted = (tokens_per_epoch - 1) // seq_length if num_samples is None else int(num_samples)
        num_epochs = max(1, math.ceil((wanted * seq_length + 1) / tokens_per_epoch))
        self.num_epochs, self.tokens_per_epoch = num_epochs, tokens_per_epoch
        description = {
            "kind": "GPTDataset", "version": INDEX_VERSION, "prefix": os.path.abspath(indexed.prefix),
            "fingerprint": [len(indexed), indexed.num_documents, int(indexed.document_lengths.sum())],
            "documents": [int(documents[0]), int(documents[-1]), len(documents)] if len(documents) else [],
            "documents_crc": zlib.crc32(documents.tobytes()), "seq_length": self.seq_length,
            "num_epochs": num_epochs, "seed": int(seed), "name": name,
        }
        if cache_dir is None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(indexed.prefix)), "cache")
        label = f"{os.path.basename(indexed.prefix)}-{name}"
        arrays = index_cache.load_or_build(cache_dir or None, label, description,
                                           lambda: self._build(documents, num_epochs, seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        # Plain ndarray views for reads: indexing an np.memmap runs Python-level overrides.
        self._doc = np.asarray(self.document_index).view(np.ndarray)
        self._sample = np.asarray(self.sample_index).view(np.ndarray)
        self._shuffle = np.asarray(self.shuffle_index).view(np.ndarray)

    def _build(self, documents: np.ndarray, num_epochs: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([int(seed), zlib.crc32(self.name.encode())])
        doc_index = build_document_index(documents, num_epochs, rng)
        lengths = self.indexed.document_lengths[doc_index]
        num_samples = (num_epochs * self.tokens_per_epoch - 1) // self.seq_length
        sample_index = build_sample_index(lengths, self.seq_length, num_samples)
        epochs = (np.arange(num_samples, dtype=np.int64) * self.seq_length) // self.tokens_per_epoch
        return {"document_index": doc_index, "sample_index": sample_index,
                "shuffle_index": build_shuffle_index(epochs, rng)}

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` token ids of sample ``idx`` (after shuffling), int64 [seq_length + 1]."""
        if not 0 <= idx < len(self):
            raise IndexError(f"{self.name} sample {idx} out of range [0, {len(self)})")
        s = int(self._shuffle[idx])
        d0, o0 = self._sample[s].tolist()
        d1, o1 = self._sample[s + 1].tolist()
        ix, doc = self.indexed, self._doc
        if d0 == d1:
            a = int(ix.document_starts[doc[d0]])
            return ix.tokens[a + o0: a + o1 + 1].astype(np.int64)
        parts = [ix.get_document(int(doc[d0]), o0)]
        parts += [ix.get_document(int(doc[d])) for d in range(d0 + 1, d1)]
        parts.append(ix.get_document(int(doc[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        window = torch.from_numpy(self.sample(idx))
        return {"tokens": window[:-1], "labels": window[1:]}


def build_datasets(prefixes_with_weights: Sequence[tuple[float, str]], seq_length: int, seed: int,
                   split: str = "969,30,1",
                   num_samples: Sequence[Optional[int]] = (None, None, None),
                   cache_dir: str | os.PathLike | None = None):
    """Train, valid and test datasets over one or several weighted indexed datasets.

    Each prefix is split by documents (:func:`split_ranges`). One prefix gives :class:`GPTDataset`
    splits; several give :class:`~paratron.data.blending.BlendedDataset` splits that draw from each
    prefix in proportion to its weight (each component is built with ``ceil(w * n * 1.005)`` + 1
    samples so that rounding never runs one dry).

    Args:
        prefixes_with_weights: ``[(weight, prefix), ...]``; weights need not sum to 1.
        seq_length: tokens per sample input.
        seed: seeds every index.
        split: ``"969,30,1"``-style shares of the documents.
        num_samples: samples wanted per split; None means one epoch; 0 gives None for that split.
        cache_dir: index cache directory (None: next to each prefix).

    Returns:
        (train, valid, test); a split is None when 0 samples are wanted, or when no prefix has a
        part of it large enough for one sample (:mod:`paratron.data.split_plan`, with a
        :class:`~paratron.data.split_plan.SplitWarning`).

    Raises:
        ValueError: empty ``prefixes_with_weights``, a non-positive weight, bad ``split``, or a
            train split too small (:func:`~paratron.data.split_plan.plan_splits`).
    """
    if not prefixes_with_weights:
        raise ValueError("build_datasets: prefixes_with_weights is empty")
    for w, p in prefixes_with_weights:
        if not w > 0:
            raise ValueError(f"data path weight {w} of {p!r} must be > 0")
    parse_split(split)
    indexed = [(float(w), IndexedDataset(p)) for w, p in prefixes_with_weights]
    plan, notes = plan_splits(indexed, split, seq_length, wanted=[n != 0 for n in num_samples])
    for note in notes:
        warnings.warn(note, SplitWarning, stacklevel=2)
    return tuple(_split_dataset(parts, num_samples[s], seq_length, seed, name, cache_dir, len(indexed) > 1)
                 for s, (name, parts) in enumerate(zip(SPLIT_NAMES, plan)))


def _split_dataset(parts, n: Optional[int], seq_length: int, seed: int, name: str, cache_dir, blend: bool):
    """One split's dataset from its parts: None without parts, a :class:`GPTDataset` for one
    prefix, else a :class:`BlendedDataset` of the parts (each built with ``ceil(w * n * 1.005) + 1``
    samples so that rounding never runs one dry)."""
    if not parts:
        return None
    if not blend:
        return GPTDataset(parts[0].dataset, parts[0].documents, seq_length, n, seed, name, cache_dir)
    total = sum(p.weight for p in parts)
    weights = [p.weight / total for p in parts]
    comps = [GPTDataset(p.dataset, p.documents, seq_length, None if n is None else math.ceil(w * n * 1.005) + 1,
                        seed, name, cache_dir) for w, p in zip(weights, parts)]
    if n is None:
        n = min(int(len(c) / w) for c, w in zip(comps, weights))
    return BlendedDataset(comps, weights, n)
