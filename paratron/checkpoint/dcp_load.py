"""One rank's DCP load, by the steps of ``torch.distributed.checkpoint.load(no_dist=True)``.

A paratron load needs no collective: each rank plans the reads of its own chunks from the saved
metadata (:class:`~paratron.checkpoint.dcp_planners.ChunkLoadPlanner`) and reads them itself, and
the outcome is exchanged afterwards by the caller
(:meth:`~paratron.checkpoint.manager.CheckpointManager.load_everywhere`). ``dcp.load`` with
``no_dist`` makes the same planner and reader calls, in this order, and around them a logging
wrapper per step (a uuid and timestamps each), two ``inspect.signature`` checks and a fallback to
rank-local metadata files paratron never writes. That wrapping costs ~0.3 ms a load on one rank and
~1 ms at 4 ranks on 2 cores: a few percent of a 64 MB shard's load (benchmarks/README.md,
checkpoints). The planner, the reader and the files are DCP's; only the driver is ours.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

__all__ = ["local_load"]


def local_load(reader: StorageReader, planner: LoadPlanner, state_dict: dict[str, Any] | None = None) -> None:
    """Fill ``planner``'s destinations from ``reader``'s checkpoint on this rank alone: read the
    metadata, set up the planner and the reader (this rank as the coordinator, as with
    ``no_dist``), plan, and read.

    Raises:
        Whatever the reader or the planner raises, as raised (``dcp.load`` would wrap it in a
        :class:`~torch.distributed.checkpoint.api.CheckpointException`).
    """
    metadata = reader.read_metadata()
    planner.set_up_planner(state_dict if state_dict is not None else {}, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    (plan,) = reader.prepare_global_plan(planner.create_global_plan([plan]))
    reader.read_data(planner.finish_plan(plan), planner).wait()
