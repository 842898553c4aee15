"""``torch.distributed.checkpoint`` planners over :class:`~paratron.checkpoint.items.SavedChunk` lists.

Save: each chunk becomes one DCP shard write (``WriteItem`` of type SHARD) with its offsets and
the full tensor's shape. Chunks that several ranks hold identically (DP replicas, TP-replicated
norms) have the same ``(key, offsets)`` index; the coordinator keeps one copy of each, choosing
for every duplicate the rank with the fewest bytes planned so far, so replicated tensors are
written once and the writing is spread across data-parallel ranks (ZeRO-style fully parallel save,
Rajbhandari et al. 2020, section 5). Loading is DCP's resharding: every local chunk reads the
overlap of each saved chunk that intersects it, so the saving and loading layouts are independent.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from . import storage
from .items import CheckpointError, SavedChunk, StateItems


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


class ChunkSavePlanner(SavePlanner):
    """Writes every :class:`SavedChunk` of ``items`` as a DCP shard; duplicates are written once.

    With ``space_root``, each rank's local plan carries the free bytes under it, and the
    coordinator refuses the save (on every rank, before anything is written) when any rank has
    less than the whole checkpoint's tensors take (each key's full tensor once); the final plans
    carry that size (:attr:`needed`), for full-disk messages. This rides on the save's planning
    round (``dcp_save.py``: every rank computes the global plan from all the local plans, so every
    rank refuses alike): no collective of its own.

    Attributes:
        needed: after planning, the bytes of the checkpoint's tensors (None without ``space_root``).

    Raises (from :meth:`create_global_plan`):
        storage.OutOfSpaceError: naming ``space_root``, the bytes needed and the fewest free.
    """

    def __init__(self, items: StateItems, space_root: str | os.PathLike | None = None) -> None:
        self.items = items
        self._by_index: dict[MetadataIndex, torch.Tensor] = {}
        self._space_root = space_root
        self.needed: int | None = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        writes = []
        for key, chunks in self.items.items():
            for c in chunks:
                index = MetadataIndex(key, c.offsets)
                if index in self._by_index:
                    raise CheckpointError(f"{key}: this rank holds two chunks at offsets {c.offsets}")
                self._by_index[index] = c.tensor
                writes.append(WriteItem(
                    index=index, type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=c.tensor.shape),
                        properties=TensorProperties.create_from_tensor(c.tensor),
                        size=torch.Size(c.global_shape))))
        free = storage.free_bytes(self._space_root) if self._space_root is not None else None
        self.plan = SavePlan(writes, planner_data=free)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        free = [p.planner_data for p in all_plans]
        plans, metadata = create_default_global_save_plan(dedup_save_plans(all_plans))
        _check_complete(metadata)
        if self._space_root is not None:
            needed = sum(math.prod(md.size) * torch.tensor([], dtype=md.properties.dtype).element_size()
                         for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata))
            if min(free) < needed:
                raise storage.OutOfSpaceError(storage.no_space_message(self._space_root, needed, min(free)))
            plans = [dataclasses.replace(p, planner_data=needed) for p in plans]
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        self.needed = new_plan.planner_data
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._by_index[write_item.index]


def _check_complete(metadata: Metadata) -> None:
    """The chunks of every saved tensor add up to the full tensor's element count.

    Identical chunks from several ranks were already reduced to one (dedup), so a sum that differs
    means a hole or an overlap: ranks that disagree on how the tensor is split.

    Raises:
        CheckpointError: naming the key and the two counts.
    """
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        volume = sum(math.prod(c.sizes) for c in md.chunks)
        if volume != math.prod(md.size):
            raise CheckpointError(
                f"{key}: the saved chunks cover {volume} elements of a tensor of shape {tuple(md.size)} "
                f"({math.prod(md.size)} elements); ranks disagree on how it is sharded")


class ChunkLoadPlanner(LoadPlanner):
    """Fills every :class:`SavedChunk` of ``items`` in place from the overlapping saved chunks.

    Raises (from :meth:`create_local_plan`):
        CheckpointError: a key is missing from the checkpoint, its full shape differs, or the saved
            chunks do not cover a local chunk.
    """

    def __init__(self, items: StateItems) -> None:
        self.items = items

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        reads: list[ReadItem] = []
        for key, chunks in self.items.items():
            md = saved.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{key} is not in the checkpoint")
            want = tuple(chunks[0].global_shape) if chunks else None
            if chunks and tuple(md.size) != want:
                raise CheckpointError(f"{key} has shape {tuple(md.size)} in the checkpoint but {want} here")
            local = [ChunkStorageMetadata(torch.Size(c.offsets), c.tensor.shape) for c in chunks]
            found = create_read_items_for_chunk_list(key, md, local)
            covered = [0] * len(chunks)
            for r in found:
                covered[r.dest_index.index] += math.prod(r.lengths)
            for c, n in zip(chunks, covered):
                if n != c.numel:
                    raise CheckpointError(f"{key}: the checkpoint covers {n} of the {c.numel} elements of the "
                                          f"chunk at offsets {c.offsets}")
            reads += found
        return LoadPlan(reads)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise CheckpointError(f"{read_item.dest_index.fqn}: paratron checkpoints hold no pickled objects")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        chunk: SavedChunk = self.items[read_item.dest_index.fqn][read_item.dest_index.index]
        return _narrow(chunk.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        # resolve_tensor returned a view of the destination, which the reader has filled.
        pass
