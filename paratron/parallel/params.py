"""What every parameter carries, so that optimizers, clipping and checkpoints need no model knowledge.

Layers call :func:`mark` on each parameter they create. The attributes:

=======================  ==================================================================
``shard``                :class:`ShardSpec`: the full (logical, unpadded) tensor's shape and this
                         rank's slice of it. Checkpoints save by it; clipping and ZeRO use it.
``tensor_parallel``      True when the tensor is split over the (expert-)TP group.
``partition_dim``        the dim split over TP (-1 when replicated).
``sequence_parallel``    replicated over TP but fed sequence-sharded activations: its grads are
                         all-reduced over TP (Korthikanti et al. 2022, section 4.2.2).
``is_expert``            an expert's param: grads reduce over ``expert_dp``, not ``dp``.
``shared_embedding``     one copy of a tied input/output embedding kept on the first *and* last
                         pipeline stage: grads are all-reduced over the ``embedding`` group, and
                         norms count only the first stage's copy.
``no_weight_decay``      biases and norm weights.
``logical_name``         the layout-independent name, e.g. ``layers.3.mlp.fc1.weight``; used to
                         seed initialisation and to key checkpoints.
=======================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of a full tensor.

    Attributes:
        global_shape: shape of the full logical tensor (vocab unpadded).
        offsets: where this rank's slice starts in the full tensor, per dim.
        local_shape: shape of the valid part of the local tensor. It can be smaller than the local
            tensor when the local tensor carries padding (vocab padding rows at the end); the valid
            part is always the leading ``local[:local_shape[0], ...]`` block.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]

    @classmethod
    def replicated(cls, shape) -> "ShardSpec":
        shape = tuple(int(s) for s in shape)
        return cls(shape, (0,) * len(shape), shape)

    def slices(self) -> tuple[slice, ...]:
        """Index of this slice inside the full tensor."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))

    def valid(self, local: torch.Tensor) -> torch.Tensor:
        """The local tensor without padding (a view)."""
        return local[tuple(slice(0, n) for n in self.local_shape)]


def mark(
    param: torch.Tensor,
    logical_name: str,
    shard: ShardSpec | None = None,
    partition_dim: int = -1,
    sequence_parallel: bool = False,
    is_expert: bool = False,
    shared_embedding: bool = False,
    no_weight_decay: bool = False,
) -> torch.Tensor:
    """Attach the attributes above to ``param`` (in place) and return it."""
    param.logical_name = logical_name
    param.shard = shard if shard is not None else ShardSpec.replicated(param.shape)
    param.partition_dim = partition_dim
    param.tensor_parallel = partition_dim >= 0
    param.sequence_parallel = sequence_parallel
    param.is_expert = is_expert
    param.shared_embedding = shared_embedding
    param.no_weight_decay = no_weight_decay
    return param


def is_replica_owner(param: torch.Tensor, tp_rank: int, is_first_stage: bool) -> bool:
    """True on exactly one copy of each logical element across TP and across tied embeddings.

    Used so that a global norm counts each logical parameter once: TP-split params count on every
    TP rank (each rank owns a disjoint slice), replicated params only on TP rank 0, and tied
    embedding copies only on the first pipeline stage.
    """
    if getattr(param, "shared_embedding", False) and not is_first_stage:
        return False
    return getattr(param, "tensor_parallel", False) or tp_rank == 0


def load_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of the full logical tensor into ``param`` (padding left as is).

    Raises:
        ValueError: ``full`` does not have the param's global shape.
    """
    spec: ShardSpec = param.shard
    if tuple(full.shape) != tuple(spec.global_shape):
        raise ValueError(f"{param.logical_name}: full tensor has shape {tuple(full.shape)}, "
                         f"expected {tuple(spec.global_shape)}")
    with torch.no_grad():
        spec.valid(param).copy_(full[spec.slices()])


def unique_params(chunks, trainable_only: bool = False) -> list[torch.nn.Parameter]:
    """The parameters of ``chunks`` (a module or a list of modules) in registration order, each
    once: a tied embedding shared by two chunks of one rank appears a single time."""
    if isinstance(chunks, torch.nn.Module):
        chunks = [chunks]
    seen, out = set(), []
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen and (p.requires_grad or not trainable_only):
                seen.add(id(p))
                out.append(p)
    return out
