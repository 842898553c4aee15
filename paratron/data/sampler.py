"""Which samples each data-parallel rank reads at each step, resumable from consumed samples.

The run reads one stream of sample ids: position ``c`` of the stream is sample
``order_e[c mod N]`` of a dataset of ``N`` samples, where ``e = c div N`` is the epoch and
``order_e`` a permutation of ``range(N)`` seeded by ``(seed, e)`` (the identity when not
shuffling). A step starting at ``consumed_samples`` takes stream positions
``consumed_samples .. consumed_samples + global_batch_size - 1``; microbatch ``k`` of the step holds
``micro_batch_size * dp_size`` of them, and data-parallel rank ``r`` gets its ``r``-th slice of
``micro_batch_size`` (the layout of Megatron-LM's ``MegatronPretrainingSampler``,
``megatron/legacy/data/data_samplers.py``).

Because a position maps to a sample by arithmetic alone, a run resumed at ``consumed_samples``
reads exactly the samples an uninterrupted run would, and each epoch visits every sample once.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np
import torch


STREAM_LENGTH = 2**62
"""The length a stream of unknown size reports: positions grow without end
(:class:`paratron.data.records.PositionSampler`, :class:`paratron.data.hf_datasets.StreamRecords`)."""


class PretrainingSampler:
    """This data-parallel rank's microbatches of sample ids, step by step.

    Args:
        total_samples: samples in the dataset (N).
        global_batch_size: samples per optimizer step over all data-parallel ranks.
        micro_batch_size: samples per microbatch on one rank.
        data_parallel_rank, data_parallel_size: this rank's place in the data-parallel group.
        seed: seeds each epoch's order.
        shuffle: reorder each epoch (else the dataset's own order every epoch). Costs one int64
            permutation of ``total_samples`` in memory.
        consumed_samples: where iteration (``iter(sampler)``) starts.

    Iterating yields this rank's microbatches (lists of ``micro_batch_size`` ids) step after step
    without end, so the sampler can serve as a ``torch.utils.data.DataLoader`` ``batch_sampler``.

    Raises:
        ValueError: a non-positive size, a rank outside ``[0, data_parallel_size)``, or a global
            batch not divisible by ``micro_batch_size * data_parallel_size`` (names the fields).
    """

    def __init__(self, total_samples: int, global_batch_size: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1, seed: int = 0,
                 shuffle: bool = True, consumed_samples: int = 0):
        for name, v in (("total_samples", total_samples), ("global_batch_size", global_batch_size),
                        ("micro_batch_size", micro_batch_size), ("data_parallel_size", data_parallel_size)):
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} must be in [0, {data_parallel_size})")
        if global_batch_size % (micro_batch_size * data_parallel_size):
            raise ValueError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size*"
                             f"data_parallel_size = {micro_batch_size}*{data_parallel_size}")
        self.total_samples, self.global_batch_size = int(total_samples), int(global_batch_size)
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, data_parallel_rank, data_parallel_size
        self.seed, self.shuffle = int(seed), shuffle
        self.num_microbatches = global_batch_size // (micro_batch_size * data_parallel_size)
        self.consumed_samples = int(consumed_samples)
        self._epoch: Optional[int] = None  # the one epoch order kept, so a step costs O(batch)
        self._order: Optional[np.ndarray] = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The sample ids of epoch ``epoch`` in reading order, int64 [total_samples]."""
        if epoch != self._epoch:
            n = self.total_samples
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                           else np.arange(n, dtype=np.int64))
            self._epoch = epoch
        return self._order

    def stream(self, start: int, count: int) -> np.ndarray:
        """Sample ids at stream positions ``start .. start + count - 1``, int64 [count]."""
        if start < 0:
            raise ValueError(f"consumed_samples={start} must be >= 0")
        out = np.empty(count, dtype=np.int64)
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs = pos // self.total_samples
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.epoch_order(int(e))[pos[sel] % self.total_samples]
        return out

    def step(self, consumed_samples: int, counts: Sequence[int] | None = None) -> list[np.ndarray]:
        """This rank's microbatches for the step starting at ``consumed_samples``:
        ``num_microbatches`` arrays of ``micro_batch_size`` sample ids.

        ``counts`` (one per DP rank, summing to ``num_microbatches * dp_size``) splits the global
        batch unevenly, e.g. to give a slow replica fewer microbatches (fail-slow mitigation). The
        step's samples are the same; each DP rank's even-split microbatches are listed rank after
        rank and rank ``r`` takes the next ``counts[r]`` of that list, so equal counts give the even
        split exactly.

        Raises:
            ValueError: ``counts`` of the wrong length, with an entry < 1, or the wrong sum.
        """
        ids = self.stream(consumed_samples, self.global_batch_size)
        per_micro, mbs = self.micro_batch_size * self.dp_size, self.micro_batch_size
        if counts is None:
            lo = self.dp_rank * mbs
            return [ids[k * per_micro + lo: k * per_micro + lo + mbs] for k in range(self.num_microbatches)]
        self.check_counts(counts)
        rank_major = [ids[k * per_micro + r * mbs: k * per_micro + (r + 1) * mbs]
                      for r in range(self.dp_size) for k in range(self.num_microbatches)]
        first = sum(counts[:self.dp_rank])
        return rank_major[first: first + counts[self.dp_rank]]

    def check_counts(self, counts: Sequence[int]) -> None:
        """Raise ValueError unless ``counts`` is a valid uneven split (see :meth:`step`)."""
        total = self.num_microbatches * self.dp_size
        if len(counts) != self.dp_size or min(counts) < 1 or sum(counts) != total:
            raise ValueError(f"microbatches per DP rank {list(counts)} must have {self.dp_size} entries, "
                             f"each >= 1, summing to global_batch_size/micro_batch_size = {total}")

    def steps(self, consumed_samples: int = 0) -> Iterator[list[np.ndarray]]:
        """:meth:`step` for ``consumed_samples``, then each following step, without end."""
        while True:
            yield self.step(consumed_samples)
            consumed_samples += self.global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for mbs in self.steps(self.consumed_samples):
            for mb in mbs:
                yield mb.tolist()


MegatronPretrainingSampler = PretrainingSampler
"""The name Megatron-LM users know."""


def batch_indices(consumed_samples: int, global_batch_size: int, dp_rank: int, dp_size: int,
                  micro_batch_size: int, total_samples: int, seed: int = 0,
                  shuffle: bool = True) -> list[np.ndarray]:
    """One step of :class:`PretrainingSampler` as a function (see there for the arguments)."""
    return PretrainingSampler(total_samples, global_batch_size, micro_batch_size, dp_rank, dp_size,
                              seed, shuffle).step(consumed_samples)


def collate(samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack samples into a microbatch: each key becomes a LongTensor [b, s]."""
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def microbatches(dataset, sampler: PretrainingSampler, consumed_samples: int = 0
                 ) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Per step, this rank's collated microbatches (``{"tokens", "labels"}``, each [b, s])."""
    for ids in sampler.steps(consumed_samples):
        yield [collate([dataset[int(i)] for i in mb]) for mb in ids]
