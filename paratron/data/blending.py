"""Blending several datasets by weights into one sample stream.

Dataset ``d`` with weight ``w_d`` places its ``k``-th sample at time ``(k + 1/2) / w_d``; the blend
is every dataset's samples merged in time order (ties to the lower dataset index), cut at ``n``.
After any prefix of length ``m`` each dataset has ``w_d * m`` samples up to rounding (within one
sample per dataset), the same guarantee as Megatron-LM's greedy ``build_blending_indices``
(``megatron/core/datasets/blended_dataset.py``), computed in one vectorised sort.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch


def blend_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """Which dataset, and which sample of it, each of ``num_samples`` blended samples comes from.

    Args:
        weights: positive weights (normalised here), one per dataset; at most 32,767 datasets.
        num_samples: length of the blend.

    Returns:
        ``dataset_index`` (int16 [num_samples]) and ``dataset_sample_index`` (int64 [num_samples]);
        the sample indices of each dataset run 0, 1, 2, ... in order.

    Raises:
        ValueError: no weights, a weight <= 0, or num_samples < 0.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or np.any(~(w > 0)) or w.size > 32767:
        raise ValueError(f"blend weights {list(weights)} must be 1..32767 positive numbers")
    if num_samples < 0:
        raise ValueError(f"num_samples={num_samples} must be >= 0")
    w = w / w.sum()
    # Enough candidates from every dataset that the first num_samples times are all present.
    counts = [math.ceil(x * num_samples) + 2 for x in w]
    times = np.concatenate([(np.arange(c, dtype=np.float64) + 0.5) / x for c, x in zip(counts, w)])
    owner = np.concatenate([np.full(c, d, dtype=np.int16) for d, c in enumerate(counts)])
    rank = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    order = np.lexsort((owner, times))[:num_samples]
    return owner[order], rank[order]


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from ``datasets`` in proportion to ``weights``.

    ``ds[i]`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``.

    Raises:
        ValueError: bad weights (see :func:`blend_indices`), or a dataset shorter than its share.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], num_samples: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = [float(x) / float(sum(weights)) for x in weights]
        self.dataset_index, self.dataset_sample_index = blend_indices(weights, num_samples)
        for d, ds in enumerate(self.datasets):
            mine = self.dataset_sample_index[self.dataset_index == d]
            need = int(mine.max()) + 1 if mine.size else 0
            if need > len(ds):
                raise ValueError(f"blended dataset {d} has {len(ds)} samples; its weight "
                                 f"{self.weights[d]:.4f} of {num_samples} needs {need}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int):
        if not 0 <= idx < len(self):
            raise IndexError(f"blended sample {idx} out of range [0, {len(self)})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
