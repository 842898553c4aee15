"""The data side of a run: tokenizer, datasets, and this DP rank's microbatches of each step.

Sample ids come from :class:`paratron.data.sampler.PretrainingSampler`: the start is set by
consumed samples only, so a resumed run reads exactly the samples an uninterrupted one would, and a
global batch holds the same samples whatever the data-parallel size. With
``data.microbatch_tokens`` the samples are whole documents and the microbatches token-balanced
packed rows (:class:`paratron.data.token_batches.TokenBudgetSampler`); consumed samples then
count documents.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from paratron.config.record_rules import record_based
from paratron.config.token_rules import row_multiple
from paratron.data.gpt_dataset import build_datasets
from paratron.data.indexed import IndexedDataset
from paratron.data.packing import pack_microbatch
from paratron.data.prepare import build_tokenizer, prepare_run_data, validation_prompt
from paratron.data.records import PositionSampler, first_prompt, record_splits
from paratron.data.sampler import PretrainingSampler, collate
from paratron.data.split_plan import SplitWarning
from paratron.data.token_batches import TokenBudgetSampler, collate_pieces, document_splits
from paratron.models.context_parallel import shard_microbatch
from paratron.models.mtp import add_mtp_targets
from paratron.training.preflight import SPLITS_CHECKED_ENV
from paratron.training.step_log import log


@dataclass
class TrainingData:
    tokenizer: object
    train_ds: object
    valid_ds: object | None
    train_sampler: object
    valid_sampler: object | None
    unigram_entropy: float | None
    prepare: Callable[[dict], dict] = field(default=lambda mb: mb)
    """Per microbatch: packed-document fields, then this CP rank's chunks (:func:`microbatch_preparer`)."""
    default_prompt: str | None = None
    """The start of a validation document: the sample prompt when train.sample_prompt is "auto"."""

    @property
    def num_microbatches(self) -> int:
        return self.train_sampler.num_microbatches

    @property
    def has_validation(self) -> bool:
        return self.valid_sampler is not None

    pad_multiple: int = 1
    """Token-balanced rows are padded to a multiple of this (the CP split, TP under sequence
    parallelism: :func:`paratron.config.token_rules.row_multiple`)."""

    def train_microbatches(self, consumed: int, counts: list[int] | None = None) -> list[dict]:
        """This DP rank's microbatches of the step at ``consumed`` samples; ``counts``: an uneven
        split, microbatches per DP rank (:meth:`PretrainingSampler.step`).

        Raises:
            ValueError: ``counts`` with token-balanced microbatches (their count is set by the data).
        """
        return self._microbatches(self.train_ds, self.train_sampler, consumed, counts)

    def valid_microbatches(self, consumed: int) -> list[dict]:
        return self._microbatches(self.valid_ds, self.valid_sampler, consumed)

    last_sample_ids: list | None = None
    """Record-based runs (:mod:`paratron.data.records`): the ``[epoch, row]`` of every sample in
    each microbatch this rank built last, a debug record (tests compare resumed runs with it)."""

    def _microbatches(self, ds, sampler, consumed: int, counts=None) -> list[dict]:
        ids_of = getattr(ds, "sample_id", None)
        if not isinstance(sampler, TokenBudgetSampler):
            steps = sampler.step(consumed, counts)
            out = [self.prepare(collate([ds[int(i)] for i in ids])) for ids in steps]
            if ids_of:  # after the reads: a stream knows its pass length once it has seen the end
                self.last_sample_ids = [[ids_of(int(i)) for i in ids] for ids in steps]
            return out
        if counts is not None:
            raise ValueError(f"an uneven split of the microbatches over DP ranks ({list(counts)}) does not apply "
                             "to data.microbatch_tokens: the data sets the microbatch count")
        plan = sampler.step(consumed)
        out = [self.prepare(collate_pieces(pieces, ds.read, self.pad_multiple, read_mask=getattr(ds, "read_mask", None)))
               for pieces in plan]
        if ids_of:
            self.last_sample_ids = [[ids_of(p.doc) + [p.start] for p in pieces] for pieces in plan]
        return out

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the data beyond the consumed counts (a streamed dataset's
        pass length: :meth:`paratron.data.hf_datasets.StreamRecords.state_dict`)."""
        records = getattr(self.train_ds, "records", None)
        return records.state_dict() if hasattr(records, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        records = getattr(self.train_ds, "records", None)
        if hasattr(records, "load_state_dict"):
            records.load_state_dict(state)

    @classmethod
    def build(cls, cfg, ctx) -> "TrainingData":
        """Tokenizer and datasets. Rank 0 preprocesses the corpus and builds the index caches
        first; the others wait at a barrier and then reuse them."""
        t = cfg.train
        if record_based(cfg):
            return cls.build_records(cfg, ctx)
        if cfg.data.microbatch_tokens is not None:
            return cls.build_token_balanced(cfg, ctx)
        n_evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 1
        num_samples = (t.train_iters * t.global_batch_size, n_evals * t.eval_iters * t.global_batch_size, 0)

        def make():
            prefixes, tok = prepare_run_data(cfg.data, progress=ctx.rank == 0 and cfg.logging.progress)
            with split_warnings_once():
                train, valid, _ = build_datasets(prefixes, cfg.model.seq_length, t.seed, split=cfg.data.split,
                                                 num_samples=num_samples, cache_dir=cfg.data.cache_dir)
            return prefixes, tok, train, valid

        if ctx.rank == 0:
            prefixes, tok, train, valid = make()
        ctx.world.barrier()
        if ctx.rank != 0:
            prefixes, tok, train, valid = make()
        if cfg.data.corpus and not cfg.data.data_path:
            cfg.data.data_path = [prefixes[0][1]]  # saved configs name the tokenised corpus itself
        entropy = unigram_entropy(prefixes) if ctx.rank == 0 else None

        def sampler(ds):
            if ds is None or len(ds) == 0:
                return None
            return PretrainingSampler(len(ds), t.global_batch_size, t.micro_batch_size,
                                      ctx.dp.rank, ctx.dp.size, seed=t.seed)

        prompt = validation_prompt(prefixes, cfg.data.split, tok)  # every rank: they agree on sampling
        return cls(tok, train, valid, sampler(train), sampler(valid), entropy, microbatch_preparer(cfg, ctx, tok.eod),
                   prompt)

    @classmethod
    def build_token_balanced(cls, cfg, ctx) -> "TrainingData":
        """Whole documents of the train and valid splits, in token-balanced microbatches
        (``data.microbatch_tokens``; :mod:`paratron.data.token_batches`)."""
        t, d = cfg.train, cfg.data
        if ctx.rank == 0:
            prefixes, tok = prepare_run_data(d, progress=cfg.logging.progress)
        ctx.world.barrier()
        if ctx.rank != 0:
            prefixes, tok = prepare_run_data(d, progress=False)
        if d.corpus and not d.data_path:
            d.data_path = [prefixes[0][1]]
        with split_warnings_once():
            train, valid = document_splits(prefixes[0][1], d.split)

        def sampler(src):
            return None if src is None else TokenBudgetSampler(
                src.lengths, t.global_batch_size, d.microbatch_tokens, cfg.model.seq_length,
                ctx.dp.rank, ctx.dp.size, seed=t.seed)

        entropy = unigram_entropy(prefixes) if ctx.rank == 0 else None
        return cls(tok, train, valid, sampler(train), sampler(valid), entropy, microbatch_preparer(cfg, ctx, tok.eod),
                   validation_prompt(prefixes, d.split, tok), row_multiple(cfg.parallel))

    @classmethod
    def build_records(cls, cfg, ctx) -> "TrainingData":
        """Chat records or a Hugging Face dataset, tokenised on demand (:mod:`paratron.data.records`):
        one document a fixed-length row, or token-balanced packed rows with ``data.microbatch_tokens``.
        Rank 0 loads first (``datasets`` builds its Arrow cache once); the others then reuse it."""
        t, d = cfg.train, cfg.data

        def make():
            tok = build_tokenizer(d)
            return (tok, *record_splits(d, tok, cfg.model.seq_length, cache_size=max(4096, 4 * t.global_batch_size)))

        if ctx.rank == 0:
            tok, train, valid, desc = make()
        ctx.world.barrier()
        if ctx.rank != 0:
            tok, train, valid, desc = make()
        log(ctx, f"data: {desc}")
        streamed = d.hf_dataset is not None and d.streaming

        def sampler(docs):
            if docs is None or len(docs) == 0:
                return None
            if d.microbatch_tokens is not None:
                stream = PositionSampler(t.global_batch_size, 1).stream if streamed else None
                return TokenBudgetSampler(docs.lengths, t.global_batch_size, d.microbatch_tokens, cfg.model.seq_length,
                                          ctx.dp.rank, ctx.dp.size, seed=t.seed, stream=stream)
            if streamed:
                return PositionSampler(t.global_batch_size, t.micro_batch_size, ctx.dp.rank, ctx.dp.size)
            return PretrainingSampler(len(docs), t.global_batch_size, t.micro_batch_size, ctx.dp.rank, ctx.dp.size,
                                      seed=t.seed)

        return cls(tok, train, valid, sampler(train), sampler(valid), None, microbatch_preparer(cfg, ctx, tok.eod),
                   first_prompt(d, tok, valid or train), row_multiple(cfg.parallel))


@contextmanager
def split_warnings_once():
    """Silence the warnings of splits left out (:class:`~paratron.data.split_plan.SplitWarning`)
    when the check before launch printed them already (:func:`paratron.training.preflight.prepare_data`)."""
    with warnings.catch_warnings():
        if os.environ.get(SPLITS_CHECKED_ENV):
            warnings.simplefilter("ignore", SplitWarning)
        yield


def microbatch_preparer(cfg, ctx, eod: int) -> Callable[[dict], dict]:
    """The function applied to every collated microbatch ``{"tokens", "labels"}`` ``[b, s]``: the
    packed-document fields of ``data.reset_position_ids`` / ``reset_attention_mask`` /
    ``eod_mask_loss`` (:func:`paratron.data.packing.pack_microbatch`), the multi-token-prediction
    targets (:func:`paratron.models.mtp.add_mtp_targets`), then this CP rank's chunks
    (:func:`paratron.models.context_parallel.shard_microbatch`; the data loader hands each CP rank
    only its tokens). Token-balanced rows (``data.microbatch_tokens``) already hold their
    positions and segments: only the loss mask and the CP split apply to them."""
    d, p = cfg.data, cfg.parallel
    fixed = d.microbatch_tokens is None

    def prepare(mb: dict) -> dict:
        mb = pack_microbatch(mb, eod, reset_position_ids=d.reset_position_ids and fixed,
                             reset_attention_mask=d.reset_attention_mask and fixed, eod_mask_loss=d.eod_mask_loss)
        mb = add_mtp_targets(mb, cfg.model.mtp_num_layers)  # on whole rows, before the CP split
        return shard_microbatch(mb, ctx.cp.rank, ctx.cp.size, p.context_algorithm)

    return prepare


def unigram_entropy(prefixes: list[tuple[float, str]]) -> float | None:
    """Entropy (nats/token) of the token frequencies of the corpus (all documents of all prefixes).

    A model that learned only token frequencies reaches this loss; anything below it used context.
    """
    counts = None
    for _, prefix in prefixes:
        ds = IndexedDataset(prefix)
        tokens = np.memmap(prefix + ".bin", dtype=ds.dtype, mode="r")
        c = np.bincount(tokens.astype(np.int64))
        if counts is None:
            counts = c
        else:
            n = max(len(c), len(counts))
            counts = np.pad(counts, (0, n - len(counts))) + np.pad(c, (0, n - len(c)))
    if counts is None or counts.sum() == 0:
        return None
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
