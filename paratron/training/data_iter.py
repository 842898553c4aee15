"""The data side of a run: tokenizer, datasets, and this DP rank's microbatches of each step.

Global batch ``k`` is samples ``[consumed, consumed + global_batch)`` of the (already shuffled) GPT
dataset; DP rank ``d`` takes the ``d``-th contiguous ``global_batch / dp`` of them and splits them
into microbatches. The start is set by consumed samples only, so a resumed run reads exactly the
samples an uninterrupted one would (Megatron's pretraining sampler does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def microbatch_sample_ids(consumed: int, global_batch: int, micro_batch: int, dp_rank: int,
                          dp_size: int, num_samples: int) -> list[list[int]]:
    """Sample ids of each microbatch of DP rank ``dp_rank`` for the global batch at ``consumed``.

    Ids wrap around ``num_samples`` (the dataset is built with enough samples for the run; the
    wrap only matters for tiny test datasets).
    """
    per_rank = global_batch // dp_size
    start = consumed + dp_rank * per_rank
    ids = [(start + i) % num_samples for i in range(per_rank)]
    return [ids[i:i + micro_batch] for i in range(0, per_rank, micro_batch)]


def collate(dataset, ids: list[int]) -> dict[str, torch.Tensor]:
    """Stack samples into ``{"tokens": [b, s], "labels": [b, s]}`` (int64)."""
    samples = [dataset[i] for i in ids]
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]).long() for k in ("tokens", "labels")}


@dataclass
class TrainingData:
    tokenizer: object
    train_ds: object
    valid_ds: object | None
    global_batch: int
    micro_batch: int
    dp_rank: int
    dp_size: int
    unigram_entropy: float | None

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp_size)

    @property
    def has_validation(self) -> bool:
        return self.valid_ds is not None and len(self.valid_ds) > 0

    def train_microbatches(self, consumed: int) -> list[dict]:
        return [collate(self.train_ds, ids) for ids in microbatch_sample_ids(
            consumed, self.global_batch, self.micro_batch, self.dp_rank, self.dp_size, len(self.train_ds))]

    def valid_microbatches(self, consumed: int) -> list[dict]:
        return [collate(self.valid_ds, ids) for ids in microbatch_sample_ids(
            consumed, self.global_batch, self.micro_batch, self.dp_rank, self.dp_size, len(self.valid_ds))]

    @classmethod
    def build(cls, cfg, ctx) -> "TrainingData":
        """Tokenizer and datasets. Rank 0 preprocesses the corpus and builds the index caches
        first; the others wait at a barrier and then reuse them."""
        from paratron.data.gpt_dataset import build_datasets
        from paratron.data.prepare import ensure_dataset
        from paratron.data.tokenizer import build_tokenizer

        t = cfg.train
        n_evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 1
        num_samples = (t.train_iters * t.global_batch_size, n_evals * t.eval_iters * t.global_batch_size, 0)

        def make():
            prefixes = ensure_dataset(cfg.data, t.seed)
            tok = build_tokenizer(cfg.data)
            train, valid, _ = build_datasets(prefixes, cfg.model.seq_length, t.seed, split=cfg.data.split,
                                             num_samples=num_samples, cache_dir=cfg.data.cache_dir)
            return prefixes, tok, train, valid

        if ctx.rank == 0:
            prefixes, tok, train, valid = make()
        ctx.world.barrier()
        if ctx.rank != 0:
            prefixes, tok, train, valid = make()
        entropy = unigram_entropy(prefixes) if ctx.rank == 0 else None
        return cls(tok, train, valid, t.global_batch_size, t.micro_batch_size, ctx.dp.rank, ctx.dp.size, entropy)


def unigram_entropy(prefixes: list[tuple[float, str]]) -> float | None:
    """Entropy (nats/token) of the token frequencies of the corpus (all documents of all prefixes).

    A model that learned only token frequencies reaches this loss; anything below it used context.
    """
    from paratron.data.indexed import IndexedDataset

    counts = None
    for _, prefix in prefixes:
        ds = IndexedDataset(prefix)
        tokens = np.asarray(ds.tokens()) if hasattr(ds, "tokens") else np.concatenate([ds[i] for i in range(len(ds))])
        c = np.bincount(tokens.astype(np.int64))
        counts = c if counts is None else np.pad(counts, (0, max(0, len(c) - len(counts)))) + np.pad(c, (0, max(0, len(counts) - len(c))))
    if counts is None or counts.sum() == 0:
        return None
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
