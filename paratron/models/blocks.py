"""Transformer blocks by name: ``model.block=NAME`` selects the layer class (DESIGN.md principle 7).

A block factory is called as ``factory(cfg, ctx, *, layer_number, seed, sequence_parallel,
params_dtype, rng_tracker)`` and returns an ``nn.Module`` whose ``forward(x, rope)`` maps hidden
``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) to the same layout; ``rope`` is the
``(cos, sin)`` pair of :func:`paratron.models.rope.rope_tables` or None. Its parameters must be
marked (``paratron.parallel.params.mark``) with names under ``layers.{layer_number}.``.

The registry is an explicit object (:class:`BlockRegistry`); :data:`BLOCKS` is the default one,
holding ``"transformer"`` (:class:`~paratron.models.layer.TransformerLayer`); a plugin adds its
own with :func:`register_block` at import time.
"""

from __future__ import annotations

import difflib
from typing import Callable

from torch import nn

from paratron.config import ConfigError

BlockFactory = Callable[..., nn.Module]


class BlockRegistry:
    """Name -> block factory."""

    def __init__(self) -> None:
        self._factories: dict[str, BlockFactory] = {}

    def register(self, name: str, factory: BlockFactory, *, replace: bool = False) -> None:
        """Add a block. Raises ``ValueError`` when ``name`` is taken (unless ``replace``)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"block name {name!r} must be a non-empty string")
        if name in self._factories and not replace:
            raise ValueError(f"block {name!r} is already registered; pass replace=True to override it")
        self._factories[name] = factory

    def get(self, name: str) -> BlockFactory:
        """The factory for ``name``.

        Raises:
            ConfigError: unknown name, naming ``model.block`` and the known ones.
        """
        if name not in self._factories:
            close = difflib.get_close_matches(name, list(self._factories), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"model.block={name!r} is not a registered block{hint}; "
                              f"known: {', '.join(sorted(self._factories))}")
        return self._factories[name]

    def names(self) -> list[str]:
        return sorted(self._factories)


def _transformer(cfg, ctx, **kw) -> nn.Module:
    from .layer import TransformerLayer

    return TransformerLayer(cfg, ctx, **kw)


BLOCKS = BlockRegistry()
BLOCKS.register("transformer", _transformer)


def register_block(name: str, factory: BlockFactory, *, replace: bool = False) -> None:
    """Add ``factory`` to :data:`BLOCKS` under ``name`` (see the module docstring for its contract)."""
    BLOCKS.register(name, factory, replace=replace)
