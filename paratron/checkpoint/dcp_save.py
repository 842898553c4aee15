"""DCP's collective save in fewer rounds than ``torch.distributed.checkpoint.save``.

``dcp.save`` plans with two object collectives (the local plans gathered to the coordinator, the
final plans scattered back) and ends with two more (the write results gathered, the outcome
broadcast), each of them two c10d collectives (sizes, then bytes). On a host where the ranks
share cores, every collective waits for each rank to be scheduled, and at a few hundred MB this
fixed cost is a fifth of the save (benchmarks/README.md, checkpoints). Here:

* the local plans are all-gathered once and every rank computes the global plan itself: the
  planners are deterministic functions of the plans (DCP's dedup and its default global plan, the
  file prefixes of ``FileSystemWriter``, our space check), so every rank gets the same plans and
  takes its own; no scatter;
* the outcome comes back as one tensor broadcast, the error itself only when there is one;
* the plans and the write results travel by :mod:`paratron.parallel.objects`: the sizes in one
  small all-reduce instead of an all-gather (gloo's all-gather is the slow round).

The calls into the planner and the storage writer are DCP's, in DCP's order; a failure on any rank
is raised on every rank as :class:`~torch.distributed.checkpoint.api.CheckpointException` naming
each failing rank, as ``dcp.save`` raises it.

Why not ``dcp.save`` with ``use_collectives=False``: each rank then writes a metadata file of its
own, and a load needs every rank's; the checkpoint is no longer one DCP checkpoint.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException, _is_wrapped_exception, _wrap_exception
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter

from paratron.parallel.objects import all_gather_objects, gather_objects

__all__ = ["collective_save"]


def _attempt(fn: Callable):
    """``fn()``, or its exception wrapped as DCP wraps one (to travel to the other ranks)."""
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001 - every rank learns of it, then every rank raises
        return _wrap_exception(e)


def _failures(results: list) -> dict:
    return {r: x for r, x in enumerate(results) if _is_wrapped_exception(x)}


def _local_plan(planner: SavePlanner, writer: StorageWriter, rank: int) -> SavePlan:
    planner.set_up_planner(state_dict={}, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    return writer.prepare_local_plan(planner.create_local_plan())


def _global_plan(planner: SavePlanner, writer: StorageWriter, plans: list[SavePlan],
                 rank: int) -> tuple[SavePlan, Metadata]:
    """This rank's final plan and the checkpoint's metadata, from every rank's local plan."""
    plans, metadata = planner.create_global_plan(plans)
    plans = writer.prepare_global_plan(plans)
    return planner.finish_plan(plans[rank]), metadata


def _write(planner: SavePlanner, writer: StorageWriter, plan: SavePlan) -> list:
    future = writer.write_data(plan, planner)
    future.wait()
    return future.value()


def collective_save(planner: SavePlanner, writer: StorageWriter, group: dist.ProcessGroup) -> None:
    """Save with ``planner`` and ``writer`` over ``group`` (every rank of it calls this); the
    group's first rank is the coordinator, which writes the metadata (``writer.finish``).

    Raises:
        CheckpointException: a rank failed in planning, writing or the coordinator's finish;
            raised on every rank, with every failing rank's exception (``.failures``).
    """
    rank = dist.get_rank(group)
    plans = all_gather_objects(_attempt(lambda: _local_plan(planner, writer, rank)), group)
    failed = _failures(plans)
    if failed:
        raise CheckpointException("plan", failed)
    planned = _attempt(lambda: _global_plan(planner, writer, plans, rank))
    if _is_wrapped_exception(planned):  # the same inputs on every rank: every rank fails alike
        raise CheckpointException("plan", {rank: planned})
    plan, metadata = planned
    results = _attempt(lambda: _write(planner, writer, plan))
    coordinator = dist.get_global_rank(group, 0)
    gathered = gather_objects(results, group, group_dst=0)
    outcome = None
    if rank == 0:
        failed = _failures(gathered)
        if not failed:
            finished = _attempt(lambda: writer.finish(metadata=metadata, results=gathered))
            failed = {0: finished} if _is_wrapped_exception(finished) else {}
        outcome = CheckpointException("write", failed) if failed else None
    flag = torch.tensor([0 if outcome is None else 1])
    dist.broadcast(flag, src=coordinator, group=group)
    if int(flag.item()):
        box = [outcome]
        dist.broadcast_object_list(box, src=coordinator, group=group)
        raise box[0]
