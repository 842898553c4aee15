"""Transformer blocks by name: ``model.block=NAME`` selects the layer class (docs/DESIGN.md principle 7).

A block factory is called as ``factory(cfg, ctx, *, layer_number, seed, sequence_parallel,
params_dtype, rng_tracker)`` and returns an ``nn.Module`` whose ``forward(x, rope)`` maps hidden
``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) to the same layout; ``rope`` is the
``(cos, sin)`` pair of :func:`paratron.models.rope.rope_tables` or None. Under context parallelism
or packed documents the block is called as ``forward(x, rope, layout)`` with the microbatch's
:class:`~paratron.models.context_parallel.SeqLayout` (its attention must then go through
:func:`~paratron.models.context_parallel.context_attention`). Its parameters must be
marked (``paratron.parallel.params.mark``) with names under ``layers.{layer_number}.``.

:data:`BLOCKS` (a :class:`paratron.registry.Registry`) holds ``"transformer"``
(:class:`~paratron.models.layer.TransformerLayer`); a plugin adds its own with
:func:`register_block` at import time.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from paratron.parallel.context import ParallelContext
from paratron.registry import Registry

from .layer import TransformerLayer

BlockFactory = Callable[..., nn.Module]


def _transformer(cfg, ctx: ParallelContext, **kw) -> nn.Module:
    return TransformerLayer(cfg, ctx, **kw)


BLOCKS: Registry[BlockFactory] = Registry("block", "model.block")
BLOCKS.register("transformer", _transformer)


def register_block(name: str, factory: BlockFactory, *, replace: bool = False) -> None:
    """Add ``factory`` to :data:`BLOCKS` under ``name`` (see the module docstring for its contract)."""
    BLOCKS.register(name, factory, replace=replace)
