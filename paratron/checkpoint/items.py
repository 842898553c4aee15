"""What a checkpoint stores: every tensor as rectangular chunks of its full logical tensor.

A :class:`SavedChunk` is a view of real storage on this rank plus where it sits in the full
tensor. One key (``model/<logical_name>``, ``optimizer/exp_avg/<logical_name>``, ...) can have
several chunks on one rank: a ZeRO-1 slice of a flattened parameter is up to three rectangles of
the tensor's 2-D view. Saving writes each chunk with the global shape; loading fills each chunk
from whatever saved chunks overlap it, so any layout loads any other (docs/DESIGN.md principle 5).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from paratron.parallel.params import is_marked, meta_of

MODEL_PREFIX = "model/"
OPTIMIZER_PREFIX = "optimizer/"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which tensor, file or field."""


class PeerCheckpointError(CheckpointError):
    """Another rank could not load the checkpoint; this rank stops with it (the message names
    that rank and its error)."""


@contextmanager
def naming_the_save(step: int) -> Iterator[None]:
    """Mark an exception raised in the block with the iteration whose save it interrupted, as
    ``exc.paratron_save`` (the first mark stays), for the launcher's failure summary: "while
    saving the checkpoint of iteration N" (:mod:`paratron.launch.failures`)."""
    try:
        yield
    except BaseException as e:
        if getattr(e, "paratron_save", None) is None:
            e.paratron_save = int(step)
        raise


@dataclass(frozen=True)
class SavedChunk:
    """One rectangular piece of a full tensor that this rank saves or loads in place.

    Attributes:
        tensor: a view of the real storage; its shape is the chunk's size. Loading copies into it.
        offsets: where the chunk starts in the full tensor, one per dim.
        global_shape: shape of the full logical tensor (vocab unpadded).
    """

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(self.tensor.shape)
        if len(shape) != len(self.offsets) or len(shape) != len(self.global_shape):
            raise CheckpointError(f"chunk of shape {shape} has offsets {self.offsets} and global shape "
                                  f"{self.global_shape}: all three need the same number of dims")
        for d, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape)):
            if o < 0 or o + n > g:
                raise CheckpointError(f"chunk of shape {shape} at offsets {self.offsets} lies outside the "
                                      f"full tensor {self.global_shape} in dim {d}")

    @property
    def numel(self) -> int:
        return math.prod(self.tensor.shape)


StateItems = dict[str, list[SavedChunk]]
"""Checkpoint key -> this rank's chunks of that tensor."""


def chunks_from_param(param: torch.Tensor) -> list[SavedChunk]:
    """The valid (unpadded) part of a marked parameter as chunks of its logical tensor: one, or
    one per block of a strided shard (:meth:`~paratron.parallel.params.ShardSpec.blocks`).

    Raises:
        CheckpointError: the parameter was never marked (no ``meta``).
    """
    if not is_marked(param):
        raise CheckpointError("a parameter without paratron.parallel.params.mark attributes "
                              f"(shape {tuple(param.shape)}) cannot be checkpointed")
    spec = param.meta.shard
    valid = spec.valid(param.detach())
    return [SavedChunk(valid[first:first + block.local_shape[0]] if spec.stride > 1 else valid,
                       tuple(block.offsets), tuple(block.global_shape))
            for first, block in spec.blocks()]


def iter_params(chunks: Iterable[torch.nn.Module] | torch.nn.Module) -> Iterable[torch.Tensor]:
    """Every parameter of the model chunks (virtual stages), each storage once."""
    if isinstance(chunks, torch.nn.Module):
        chunks = [chunks]
    seen: set[int] = set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def model_items(chunks, *, is_first_stage: bool = True, for_save: bool = True) -> StateItems:
    """``model/<logical_name>`` -> chunks of this rank's parameters.

    Args:
        chunks: the model chunks (one ``nn.Module`` per virtual pipeline stage) or one module.
        is_first_stage: whether this rank is on the first pipeline stage.
        for_save: drop the tied-embedding copy of non-first stages (its values equal the first
            stage's copy, so saving it twice would write overlapping chunks). Loading keeps it:
            both copies must be filled.

    Raises:
        CheckpointError: two parameters of this rank claim the same chunk of one logical tensor.
    """
    out: StateItems = {}
    for p in iter_params(chunks):
        if for_save and meta_of(p).shared_embedding and not is_first_stage:
            continue
        key = MODEL_PREFIX + meta_of(p).logical_name
        mine = out.setdefault(key, [])
        for c in chunks_from_param(p):
            if for_save and any(o.offsets == c.offsets for o in mine):
                raise CheckpointError(f"{key}: two parameters on this rank hold the chunk at offsets {c.offsets}")
            mine.append(c)
    return out


def shared_embedding_names(chunks) -> set[str]:
    """Logical names of tied-embedding parameters (first and last stage hold a copy each)."""
    return {p.meta.logical_name for p in iter_params(chunks) if meta_of(p).shared_embedding}


def optimizer_items(optimizer, *, skip_names: set[str] = frozenset()) -> StateItems:
    """Chunks of the optimizer's fp32 main weights and moments, from ``opt.sharded_state_dict()``.

    The optimizer returns ``{"optimizer/<kind>/<logical_name>": [(view, ShardSpec), ...]}``; each
    ShardSpec is relative to the full tensor's 2-D view ``[prod(shape[:-1]), shape[-1]]``.
    ``skip_names`` drops keys whose logical name is listed (the tied-embedding copy of the last
    stage on save).

    Raises:
        CheckpointError: a key without the ``optimizer/`` prefix, or a malformed chunk.
    """
    out: StateItems = {}
    for key, pieces in optimizer.sharded_state_dict().items():
        if not key.startswith(OPTIMIZER_PREFIX):
            raise CheckpointError(f"optimizer state key {key!r} must start with {OPTIMIZER_PREFIX!r}")
        if key.split("/", 2)[-1] in skip_names:
            continue
        out[key] = [SavedChunk(t.detach(), tuple(spec.offsets), tuple(spec.global_shape))
                    for t, spec in pieces]
    return out


def merge(*parts: StateItems) -> StateItems:
    """Union of item dicts; a key may appear in only one part.

    Raises:
        CheckpointError: a key appears twice.
    """
    out: StateItems = {}
    for part in parts:
        for k, v in part.items():
            if k in out:
                raise CheckpointError(f"checkpoint key {k!r} is produced twice")
            out[k] = v
    return out


def full_items(tensors: dict[str, torch.Tensor], prefix: str = MODEL_PREFIX) -> StateItems:
    """Whole tensors as single chunks (one process holds everything)."""
    return {prefix + name: [SavedChunk(t.detach(), (0,) * t.dim(), tuple(t.shape))]
            for name, t in tensors.items()}
