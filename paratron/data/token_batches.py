"""Token-balanced variable-length microbatches of whole documents (``data.microbatch_tokens``).

FlexPipe (Jiang et al., USENIX ATC'25) stops sizing every microbatch for the longest sequence
when document lengths vary. Here a microbatch is one packed row of whole documents holding at
most ``N = data.microbatch_tokens`` positions, and the number of microbatches of a step follows
from the tokens the step holds. How a step's work is formed, exactly:

positions
    a document of ``L`` tokens (its end-of-document token included) gives ``L - 1`` positions,
    input ``d[i]`` and label ``d[i + 1]``; each document is its own attention segment with
    positions restarting at 0, so no token sees another document. A document of fewer than 2
    tokens has nothing to predict and takes no space.
pieces
    a document of more than ``S = model.seq_length`` positions is cut into pieces of ``S``
    positions (the last one shorter), each its own segment; every label of the document is in
    exactly one piece. ``N >= S`` (a config rule), so every piece fits a microbatch.
global batch
    the step at ``consumed`` documents reads stream positions ``consumed .. consumed + G - 1``
    (``G = train.global_batch_size`` documents) of the document stream of
    :class:`~paratron.data.sampler.PretrainingSampler` (epoch ``e``: the split's documents in a
    permutation seeded by ``(seed, e)``), and takes their pieces in stream order. The data
    position to checkpoint is ``consumed`` (``consumed_train_samples`` counts documents).
microbatches
    ``K`` bins, filled by longest-processing-time-first (Graham 1969): pieces by decreasing
    length (ties: stream order), each into the least-filled bin (ties: the lowest index).
    ``K`` is the smallest multiple of ``dp`` from ``dp * ceil(T / (N * dp))`` on (``T``: the
    step's positions) at which every bin holds at most ``N`` positions, and at most ``P``
    (the step's pieces, so no bin is empty; if even ``dp * floor(P / dp)`` bins cannot keep
    under ``N``, those bins are used). Within a bin the pieces keep stream order.
data parallelism
    bin ``k`` is microbatch ``k // dp`` of DP rank ``k % dp``: every rank has ``K / dp``
    microbatches, every piece is on exactly one rank.

Everything depends only on the documents' lengths, ``seed``, ``consumed``, ``G``, ``N``, ``S``
and ``dp``: never on the pipeline or tensor layout, and every rank computes the same plan
without communication (all pipeline stages of a replica thus know every microbatch's shape).
The loss is the token mean over every label of the global batch, whatever the grouping.
"""

from __future__ import annotations

import heapq
import math
import warnings
from typing import NamedTuple, Sequence

import numpy as np
import torch

from paratron.data.indexed import IndexedDataset
from paratron.data.sampler import PretrainingSampler
from paratron.data.split_plan import RUN_SPLITS, SplitWarning, plan_splits

IGNORE_INDEX = -100


class Piece(NamedTuple):
    """Positions ``start .. stop - 1`` of a document: inputs ``d[start:stop]``, labels
    ``d[start + 1:stop + 1]``. ``doc`` is the document's index in the split's ``documents``."""

    doc: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def document_pieces(doc: int, num_tokens: int, max_positions: int) -> list[Piece]:
    """The pieces of a document of ``num_tokens`` tokens (see the module docstring)."""
    positions = num_tokens - 1
    return [Piece(doc, a, min(a + max_positions, positions)) for a in range(0, max(positions, 0), max_positions)]


def balance(sizes: Sequence[int], bins: int) -> list[list[int]]:
    """Longest-processing-time-first: item indices per bin (each bin's items ascending).
    Items by decreasing size (ties: lower index first) go to the least-filled bin (ties: the lower
    bin index)."""
    heap = [(0, k) for k in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, k = heapq.heappop(heap)
        out[k].append(i)
        heapq.heappush(heap, (load + sizes[i], k))
    return [sorted(b) for b in out]


def plan_microbatches(pieces: Sequence[Piece], microbatch_tokens: int, dp: int) -> list[list[Piece]]:
    """Split one global batch's pieces (stream order) into ``K`` microbatches, bin ``k`` for DP rank
    ``k % dp`` (see the module docstring for the rule).

    Raises:
        ValueError: fewer pieces than DP ranks (a rank would get no microbatch).
    """
    n = len(pieces)
    if n < dp:
        raise ValueError(f"the global batch has {n} non-empty documents (or pieces), fewer than the "
                         f"{dp} data-parallel ranks; raise train.global_batch_size")
    sizes = [p.size for p in pieces]
    top = dp * (n // dp)
    k = min(top, dp * math.ceil(sum(sizes) / (microbatch_tokens * dp)))
    while True:
        bins = balance(sizes, k)
        if k >= top or max(sum(sizes[i] for i in b) for b in bins) <= microbatch_tokens:
            return [[pieces[i] for i in b] for b in bins]
        k += dp


class TokenBudgetSampler:
    """This DP rank's token-balanced microbatches (lists of :class:`Piece`) step by step.

    Args:
        lengths: tokens of each document of the split, int [n] (``IndexedDataset.document_lengths``
            of the split's documents).
        global_batch_size: documents per step (G).
        microbatch_tokens: positions per microbatch at most (N).
        max_positions: positions per piece at most (S, ``model.seq_length``).
        data_parallel_rank, data_parallel_size: this rank's place in the DP group.
        seed, shuffle: the document stream's order (as :class:`PretrainingSampler`).
        stream: ``(start, count) -> document ids`` to use instead of that order (a streamed
            dataset's positions, :class:`paratron.data.records.PositionSampler`); ``lengths`` may
            then be lazy (``len()`` and ``lengths[d]``, :class:`paratron.data.records.LazyLengths`).

    Raises:
        ValueError: a non-positive size, or ``microbatch_tokens < max_positions``.
    """

    num_microbatches = None
    """Varies per step (the training loop builds the schedule for each count)."""

    def __init__(self, lengths: np.ndarray, global_batch_size: int, microbatch_tokens: int, max_positions: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1, seed: int = 0, shuffle: bool = True,
                 stream=None):
        if microbatch_tokens < max_positions or max_positions < 1:
            raise ValueError(f"microbatch_tokens={microbatch_tokens} must be >= max_positions={max_positions} >= 1")
        self.lengths = np.asarray(lengths, dtype=np.int64) if isinstance(lengths, (list, tuple, np.ndarray)) else lengths
        self.stream = stream or PretrainingSampler(len(self.lengths), global_batch_size, 1, 0, 1, seed, shuffle).stream
        self.global_batch_size, self.microbatch_tokens = global_batch_size, microbatch_tokens
        self.max_positions = max_positions
        self.dp_rank, self.dp_size = data_parallel_rank, data_parallel_size

    def global_plan(self, consumed: int) -> list[list[Piece]]:
        """Every microbatch of the step at ``consumed`` documents (bin ``k`` for DP rank ``k % dp``)."""
        pieces = [p for d in self.stream(consumed, self.global_batch_size).tolist()
                  for p in document_pieces(d, int(self.lengths[d]), self.max_positions)]
        return plan_microbatches(pieces, self.microbatch_tokens, self.dp_size)

    def step(self, consumed: int) -> list[list[Piece]]:
        """This DP rank's microbatches of the step at ``consumed`` documents."""
        return self.global_plan(consumed)[self.dp_rank::self.dp_size]


def collate_pieces(pieces: Sequence[Piece], read, multiple_of: int = 1, pad_id: int = 0,
                   read_mask=None) -> dict[str, torch.Tensor]:
    """One packed row of ``pieces``.

    Args:
        pieces: the microbatch's pieces, in row order.
        read: ``(doc, start, stop) -> int array`` of the document's tokens ``start .. stop - 1``.
        multiple_of: pad the row to a multiple of this many positions (sequence parallelism
            splits it over TP); the padding is one more segment with ignored labels.
        pad_id: token id of the padding.
        read_mask: ``(doc, start, stop) -> bool array``, True where a token is a loss target (chat
            data: the assistant's tokens); a label is ignored (-100) where its token is not.

    Returns:
        ``tokens``, ``labels``, ``position_ids`` ``[1, s]`` int64 (labels -100 on padding) and
        ``cu_seqlens`` ``[1, D + 1]`` (segment starts, then ``s``), ``s`` = the pieces' positions
        rounded up to ``multiple_of``.
    """
    toks, labs, pos, starts = [], [], [], [0]
    for p in pieces:
        window = np.asarray(read(p.doc, p.start, p.stop + 1), dtype=np.int64)
        toks.append(window[:-1])
        labs.append(window[1:] if read_mask is None else
                    np.where(read_mask(p.doc, p.start + 1, p.stop + 1), window[1:], IGNORE_INDEX))
        pos.append(np.arange(p.size, dtype=np.int64))
        starts.append(starts[-1] + p.size)
    pad = -starts[-1] % multiple_of
    if pad:
        toks.append(np.full(pad, pad_id, dtype=np.int64))
        labs.append(np.full(pad, IGNORE_INDEX, dtype=np.int64))
        pos.append(np.arange(pad, dtype=np.int64))
        starts.append(starts[-1] + pad)
    row = {"tokens": toks, "labels": labs, "position_ids": pos}
    out = {k: torch.from_numpy(np.concatenate(v))[None] for k, v in row.items()}
    out["cu_seqlens"] = torch.tensor([starts], dtype=torch.int64)
    return out


class DocumentSource:
    """The documents of one split of an indexed dataset, read by split-local index.

    Args:
        indexed: the :class:`~paratron.data.indexed.IndexedDataset`.
        documents: its document ids of this split, int [n].
    """

    def __init__(self, indexed, documents: np.ndarray):
        self.indexed, self.documents = indexed, np.asarray(documents, dtype=np.int64)
        self.lengths = indexed.document_lengths[self.documents]

    def __len__(self) -> int:
        return len(self.documents)

    def read(self, doc: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop - 1`` of the split's document ``doc``."""
        return self.indexed.get_document(int(self.documents[doc]), start, stop - start)


def document_splits(prefix: str, split: str) -> tuple[DocumentSource | None, DocumentSource | None]:
    """The train and valid documents of ``prefix`` under ``data.split``, by the rule of
    :func:`paratron.data.split_plan.plan_splits` for whole documents: None for a valid split with
    no document of 2 tokens or more (with a :class:`~paratron.data.split_plan.SplitWarning`).

    Raises:
        ValueError: a train split with no such document.
    """
    ds = IndexedDataset(prefix)
    plan, notes = plan_splits([(1.0, ds)], split, 0, whole_documents=True, wanted=RUN_SPLITS)
    for note in notes:
        warnings.warn(note, SplitWarning, stacklevel=2)
    return tuple(DocumentSource(ds, parts[0].documents) if parts else None for parts in plan[:2])
