"""Dropout that draws from the right random stream under tensor parallelism (Shoeybi et al.
2019, section 3: dropout inside a TP region, or on activations that differ across TP ranks, must
draw a different mask on each rank; dropout on replicated activations must draw the same one).

Both functions take the model's :class:`~paratron.parallel.random.RNGStatesTracker` (or None on a
model without one), whose ``model-parallel`` stream differs per TP rank while the default
generator is identical over TP.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def rng_fork(rng_tracker, enabled: bool):
    """The tracker's ``model-parallel`` stream when ``enabled`` (dropout on activations that
    differ across tensor-parallel ranks), else the default generator."""
    if enabled and rng_tracker is not None:
        return rng_tracker.fork("model-parallel")
    return nullcontext()


def dropout(x: torch.Tensor, p: float, training: bool, rng_tracker=None, split_over_tp: bool = False
            ) -> torch.Tensor:
    """Dropout with probability ``p``; draws from the model-parallel stream when ``split_over_tp``
    (the activation is split over tensor-parallel ranks, e.g. sequence-parallel hidden states)."""
    if p == 0.0 or not training:
        return x
    with rng_fork(rng_tracker, split_over_tp):
        return torch.nn.functional.dropout(x, p, True)
