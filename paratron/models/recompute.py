"""Activation recompute that replays dropout exactly (Korthikanti et al. 2022, sections 3 and 5;
Chen et al. 2016 for checkpointing itself).

:func:`checkpointed` runs a function without keeping its activations and runs it again in the
backward pass, in the reentrant style of Megatron-LM's ``CheckpointFunction``: the forward runs
under ``no_grad`` keeping only the inputs; the backward restores the RNG states of the forward,
recomputes with grad enabled and back-propagates through the recomputed graph. The RNG states
restored are the default generators *and* the tracker's named streams (the ``model-parallel``
stream used for dropout inside tensor-parallel regions), so recomputed dropout masks are
bit-identical.

Why not ``torch.utils.checkpoint(use_reentrant=False)``: it hands saved tensors back *detached*
in the backward, while paratron's linear layers read the saved weight in their backward to
accumulate its grad (``paratron.parallel.grads.accumulate_grad``); the reentrant form recomputes
a real graph over the real parameters.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import torch


def _capture_default() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_default(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _get_states(tracker):
    # With a tracker, its get_states() holds the default generators too (under "default").
    return tracker.get_states() if tracker is not None else {"default": _capture_default()}


def _set_states(tracker, states) -> None:
    if tracker is not None:
        tracker.set_states(states)
    else:
        _restore_default(states["default"])


class _Checkpoint(torch.autograd.Function):
    """forward(fn, tracker, *args) = fn(*args) without saved activations; backward recomputes."""

    @staticmethod
    def forward(ctx, fn, tracker, *args):
        ctx.fn, ctx.tracker = fn, tracker
        ctx.rng_states = _get_states(tracker)
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        ctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, grad_out):
        saved = iter(ctx.saved_tensors)
        inputs = []
        for is_tensor, other in zip(ctx.is_tensor, ctx.others):
            if is_tensor:
                t = next(saved)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(other)
        now = _get_states(ctx.tracker)
        _set_states(ctx.tracker, ctx.rng_states)
        try:
            with torch.enable_grad():
                out = ctx.fn(*inputs)
        finally:
            _set_states(ctx.tracker, now)
        torch.autograd.backward(out, grad_out)
        grads = tuple(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in inputs)
        return (None, None) + grads


def checkpointed(fn: Callable[..., torch.Tensor], *args, rng_tracker=None) -> torch.Tensor:
    """``fn(*args)`` (one tensor out) with its activations recomputed in the backward.

    Args:
        fn: the function (a layer's forward, or the attention core).
        args: its arguments; tensors among them are kept for the recompute.
        rng_tracker: the model's :class:`paratron.parallel.random.RNGStatesTracker` or None; its
            streams and the default generators are replayed so dropout masks are identical.

    When no tensor argument requires grad there is nothing to recompute into (the reentrant form
    needs a grad path through its inputs), so ``fn`` runs plainly.
    """
    if not torch.is_grad_enabled() or not any(torch.is_tensor(a) and a.requires_grad for a in args):
        return fn(*args)
    return _Checkpoint.apply(fn, rng_tracker, *args)


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
