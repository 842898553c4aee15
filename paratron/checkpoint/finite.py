"""A checkpoint never holds an inf or NaN: the state is checked on every rank before a save.

Every rank scans the tensors it is about to write (the model params and the optimizer's fp32
main weights and moments: one ``isfinite`` pass, small next to the write itself), and one MAX
all-reduce over the checkpoint group makes the verdict global, so either every rank writes or
none does, and ``latest`` keeps naming the last good checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .items import CheckpointError, StateItems


def first_nonfinite(items: StateItems) -> str | None:
    """The key of the first item (in key order) with an inf or NaN in one of its chunks."""
    for key in sorted(items):
        for chunk in items[key]:
            t = chunk.tensor
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return key
    return None


def refuse_nonfinite(items: StateItems, step: int, group) -> None:
    """Raise on every rank if any rank's ``items`` hold an inf or NaN.

    Args:
        items: this rank's checkpoint items.
        step: the step being saved (for the message).
        group: the checkpoint's :class:`~paratron.parallel.comm.Group` over all ranks.

    Raises:
        CheckpointError: naming the step, and the first bad key and rank.
    """
    bad = first_nonfinite(items)
    flag = torch.tensor([1.0 if bad is not None else 0.0])
    group.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() == 0:
        return
    found = group.all_gather_object(bad)
    rank = next(r for r, k in enumerate(found) if k is not None)
    raise CheckpointError(f"refusing to save step {step}: {found[rank]} holds an inf or NaN on rank "
                          f"{rank}; the checkpoints already saved are left as they are")
