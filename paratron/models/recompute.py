"""Activation recompute that replays dropout exactly (Korthikanti et al. 2022, sections 3 and 5;
Chen et al. 2016 for checkpointing itself).

:func:`checkpointed` runs a function under ``torch.utils.checkpoint`` (non-reentrant): its
activations are dropped after the forward and recomputed in the backward. ``torch.utils.checkpoint``
restores the default generator's state before recomputing; the RNG *tracker*'s named states
(the ``model-parallel`` stream used for dropout inside tensor-parallel regions) live outside it,
so we snapshot them when the forward runs and reinstate them around the recompute, then put
back whatever they had become. The recomputed dropout masks are then bit-identical.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint


def _tracker_contexts(tracker):
    snapshot: dict[str, Any] = {}

    @contextmanager
    def forward_ctx():
        snapshot["states"] = tracker.get_states(include_default=False)
        yield

    @contextmanager
    def recompute_ctx():
        current = tracker.get_states(include_default=False)
        tracker.set_states(snapshot["states"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return forward_ctx(), recompute_ctx()


def checkpointed(fn: Callable[..., Any], *args, rng_tracker=None) -> Any:
    """``fn(*args)`` with its activations recomputed in the backward.

    Args:
        fn: the function (a layer's forward, or the attention core).
        args: its tensor (or other) arguments.
        rng_tracker: the model's RNG tracker (``paratron.parallel.random.RNGStatesTracker``) or None;
            its states are replayed in the recompute so dropout masks are identical.
    """
    if rng_tracker is None:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: _tracker_contexts(rng_tracker))


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
