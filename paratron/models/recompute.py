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

from typing import Callable

import torch

from paratron.parallel.random import capture_default_states, restore_default_states


def _get_states(tracker):
    # With a tracker, its get_states() holds the default generators too (under "default").
    return tracker.get_states() if tracker is not None else {"default": capture_default_states()}


def _set_states(tracker, states) -> None:
    if tracker is not None:
        tracker.set_states(states)
    else:
        restore_default_states(states["default"])


class _Checkpoint(torch.autograd.Function):
    """forward(fn, tracker, *args) = fn(*args) without saved activations; backward recomputes."""

    @staticmethod
    def forward(fctx, fn, tracker, *args):
        fctx.fn, fctx.tracker = fn, tracker
        fctx.rng_states = _get_states(tracker)
        fctx.is_tensor = [torch.is_tensor(a) for a in args]
        fctx.others = [None if t else a for a, t in zip(args, fctx.is_tensor)]
        fctx.save_for_backward(*[a for a in args if torch.is_tensor(a)])
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(fctx, grad_out):
        saved = iter(fctx.saved_tensors)
        inputs = []
        for is_tensor, other in zip(fctx.is_tensor, fctx.others):
            if is_tensor:
                t = next(saved)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(other)
        now = _get_states(fctx.tracker)
        _set_states(fctx.tracker, fctx.rng_states)
        try:
            with torch.enable_grad():
                out = fctx.fn(*inputs)
        finally:
            _set_states(fctx.tracker, now)
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
