"""What every parameter carries, so that optimizers, clipping and checkpoints need no model knowledge.

Layers call :func:`mark` on each parameter they create; it attaches one typed
:class:`ParamMeta` as ``param.meta`` (the only attribute paratron puts on a parameter). Its fields:

=======================  ==================================================================
``logical_name``         the layout-independent name, e.g. ``layers.3.mlp.fc1.weight``; used to
                         seed initialisation and to key checkpoints.
``shard``                :class:`ShardSpec`: the full (logical, unpadded) tensor's shape and this
                         rank's slice of it. Checkpoints save by it; clipping and ZeRO use it.
``partition_dim``        the dim split over TP (-1 when replicated); ``tensor_parallel`` (a
                         property) is True when it is split over the (expert-)TP group.
``sequence_parallel``    replicated over TP but fed sequence-sharded activations: its grads are
                         all-reduced over TP (Korthikanti et al. 2022, section 4.2.2).
``is_expert``            an expert's param: grads reduce over ``expert_dp``, not ``dp``.
``shared_embedding``     one copy of a tied input/output embedding kept on the first *and* last
                         pipeline stage: grads are all-reduced over the ``embedding`` group, and
                         norms count only the first stage's copy.
``no_weight_decay``      biases and norm weights.
``grad_uses``            how many grads one backward pass gives the param (default 1; an expert
                         run once per dispatch chunk); DDP starts the param's bucket reduction
                         during the last backward only after that many.
``qkv_split``            on a fused QKV weight: ``(groups, (q_rows, k_rows, v_rows))``: dim 0 of
                         the full tensor is ``groups`` row blocks ``[q; k; v]`` (Muon
                         orthogonalises Q, K and V separately, :mod:`paratron.optim.muon`).
=======================  ==================================================================

Set by :class:`~paratron.optim.ddp.DistributedDataParallel` (None until then): ``main_grad``
(the fp32 view into the grad buffer that linears accumulate into; under ZeRO-2/3 attached while
its bucket is staged), ``grad_ready_hook(param)`` (called after each grad lands) and
``acquire_main_grad(param)`` (ZeRO-2/3: stage the bucket and return ``main_grad``). ``main_grad``
lives in the meta like the rest: the hot path (:func:`paratron.parallel.grads.accumulate_grad`)
pays one attribute lookup more, and nothing outside paratron reads it.

:func:`meta_of` reads the meta of a parameter that may be unmarked (a frozen or foreign
parameter): it then returns the defaults, as if the parameter were replicated and plain.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of a full tensor.

    Attributes:
        global_shape: shape of the full logical tensor (vocab unpadded).
        offsets: where this rank's slice starts in the full tensor, per dim (with ``stride > 1``,
            dim 0's offset is inside each block).
        local_shape: shape of the valid part of the local tensor. It can be smaller than the local
            tensor when the local tensor carries padding (vocab padding rows at the end); the valid
            part is always the leading ``local[:local_shape[0], ...]`` block.
        stride: a fused tensor made of ``stride`` equal blocks along dim 0 (SwiGLU's
            ``[gate; up]``): this rank holds the same rows of every block, block after block, so
            its slice is ``stride`` contiguous pieces (Megatron-LM's ``partition_stride``). Such a
            shard carries no padding.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    stride: int = 1

    def __post_init__(self) -> None:
        if self.stride > 1 and (self.global_shape[0] % self.stride or self.local_shape[0] % self.stride):
            raise ValueError(f"a shard with stride {self.stride} needs dim 0 of the full shape "
                             f"{self.global_shape} and of the local shape {self.local_shape} to divide by it")

    @classmethod
    def replicated(cls, shape) -> "ShardSpec":
        shape = tuple(int(s) for s in shape)
        return cls(shape, (0,) * len(shape), shape)

    def blocks(self) -> list[tuple[int, "ShardSpec"]]:
        """The contiguous pieces of this slice: ``(first local row, piece's ShardSpec)`` each, in
        local order; one piece (this spec) unless ``stride > 1``."""
        if self.stride == 1:
            return [(0, self)]
        n, block = self.local_shape[0] // self.stride, self.global_shape[0] // self.stride
        return [(k * n, ShardSpec(self.global_shape, (k * block + self.offsets[0],) + tuple(self.offsets[1:]),
                                  (n,) + tuple(self.local_shape[1:])))
                for k in range(self.stride)]

    def slices(self) -> tuple:
        """Index of this slice inside the full tensor: ``full[spec.slices()]`` reads it and
        ``full[spec.slices()] = local`` writes it. Slices, except that a strided shard indexes
        dim 0 with the tensor of its rows (so the result is a copy, not a view)."""
        if self.stride == 1:
            return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))
        rest = tuple(slice(o, o + n) for o, n in zip(self.offsets[1:], self.local_shape[1:]))
        rows = torch.cat([torch.arange(b.offsets[0], b.offsets[0] + b.local_shape[0]) for _, b in self.blocks()])
        return (rows,) + rest

    def valid(self, local: torch.Tensor) -> torch.Tensor:
        """The local tensor without padding (a view)."""
        return local[tuple(slice(0, n) for n in self.local_shape)]


@dataclass(eq=False)
class ParamMeta:
    """The metadata :func:`mark` attaches to a parameter as ``param.meta`` (fields: see the
    module docstring). Mutable: DDP sets the last three; models set ``shared_embedding``,
    ``grad_uses`` and ``qkv_split`` after marking."""

    logical_name: str
    shard: ShardSpec
    partition_dim: int = -1
    sequence_parallel: bool = False
    is_expert: bool = False
    shared_embedding: bool = False
    no_weight_decay: bool = False
    grad_uses: int = 1
    qkv_split: tuple[int, tuple[int, int, int]] | None = None
    main_grad: torch.Tensor | None = None
    grad_ready_hook: Callable[[torch.Tensor], None] | None = None
    acquire_main_grad: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def tensor_parallel(self) -> bool:
        """True when the tensor is split over the (expert-)TP group."""
        return self.partition_dim >= 0


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
    """Attach a :class:`ParamMeta` as ``param.meta`` (in place) and return ``param``."""
    param.meta = ParamMeta(logical_name, shard if shard is not None else ShardSpec.replicated(param.shape),
                           partition_dim, sequence_parallel, is_expert, shared_embedding, no_weight_decay)
    return param


def is_marked(param: torch.Tensor) -> bool:
    """True when :func:`mark` has given ``param`` its :class:`ParamMeta`."""
    return isinstance(getattr(param, "meta", None), ParamMeta)


def meta_of(param: torch.Tensor) -> ParamMeta:
    """``param.meta``, or for an unmarked param a fresh default (replicated, plain, no name):
    for reads that must tolerate params :func:`mark` never saw."""
    meta = getattr(param, "meta", None)
    return meta if isinstance(meta, ParamMeta) else ParamMeta("", ShardSpec.replicated(param.shape))


def is_replica_owner(param: torch.Tensor, tp_rank: int, is_first_stage: bool) -> bool:
    """True on exactly one copy of each logical element across TP and across tied embeddings.

    Used so that a global norm counts each logical parameter once: TP-split params count on every
    TP rank (each rank owns a disjoint slice), replicated params only on TP rank 0, and tied
    embedding copies only on the first pipeline stage.
    """
    meta = meta_of(param)
    if meta.shared_embedding and not is_first_stage:
        return False
    return meta.tensor_parallel or tp_rank == 0


def load_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of the full logical tensor into ``param`` (padding left as is).

    Raises:
        ValueError: ``full`` does not have the param's global shape.
    """
    spec: ShardSpec = param.meta.shard
    if tuple(full.shape) != tuple(spec.global_shape):
        raise ValueError(f"{param.meta.logical_name}: full tensor has shape {tuple(full.shape)}, "
                         f"expected {tuple(spec.global_shape)}")
    with torch.no_grad():
        spec.valid(param).copy_(full[spec.slices()])


def gather_full(local: torch.Tensor, param: torch.Tensor, group) -> torch.Tensor:
    """The full logical tensor of ``local`` (``param``'s data or grad on this rank), gathered over
    ``group`` (the TP group ``param`` is split over; every rank of it must call this), without
    vocab padding. A strided shard's pieces are put back block by block.
    """
    spec: ShardSpec = param.meta.shard
    if param.meta.tensor_parallel:
        local = group.all_gather(local.contiguous(), dim=param.meta.partition_dim)
        if spec.stride > 1:  # [r0: b0 b1 | r1: b0 b1] -> [b0: r0 r1 | b1: r0 r1]
            shape = local.shape
            local = local.reshape(group.size, spec.stride, -1, *shape[1:]).transpose(0, 1).reshape(shape)
    return local[tuple(slice(0, n) for n in spec.global_shape)]


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
