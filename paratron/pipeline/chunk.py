"""The interface a model chunk offers the pipeline runtime.

The runtime (:mod:`.runtime`) needs four things of a chunk beyond ``nn.Module``: where its
deferred weight grads go (zero-bubble ``B``/``W``), how to cut its graph at layer boundaries and
how to hook its in-flight all-to-alls (the backward and forward halves of an ``FB`` pair,
:mod:`.fb_pair`), and its RNG tracker (an ``R`` replays the forward's dropout masks).
:class:`~paratron.models.gpt.GPTChunk` implements :class:`PipelineChunk`; any other module is
run through :class:`ModuleChunk`, which gives the plain answers (no cuts, no hooks, the default
RNG streams).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import nn

from ..parallel.grads import WeightGradStore, attach_weight_grad_store

Cut = Callable[[torch.Tensor], torch.Tensor]
"""``h -> h'``: called on the activation before each layer (and before the head); returns what
the layer should consume (a fresh leaf when the graph is cut there)."""

InFlightHook = Callable[[str, Callable[[], None]], None]
"""``(what, wait) -> None``: called by a dispatcher right after launching an all-to-all
asynchronously (``what`` names it); it may compute, and must call ``wait()`` before returning."""


@runtime_checkable
class PipelineChunk(Protocol):
    """A model chunk as the pipeline runtime drives it.

    Attributes:
        rng_tracker: the :class:`~paratron.parallel.random.RNGStatesTracker` its dropout draws
            from, or None (the default CPU/CUDA generators).
    """

    rng_tracker: object | None

    def use_weight_grad_store(self, store: WeightGradStore) -> None:
        """Queue the weight grads of this chunk's deferring layers in ``store``."""

    def layer_boundaries(self, cut: Cut) -> AbstractContextManager:
        """While inside: the forward calls ``h = cut(h)`` before each layer and before the head."""

    def in_flight_hook(self, hook: InFlightHook) -> AbstractContextManager:
        """While inside: every all-to-all the forward launches asynchronously calls ``hook``."""


class ModuleChunk:
    """A plain ``nn.Module`` as a :class:`PipelineChunk`: its deferring layers share the store,
    its graph is never cut, nothing is hooked and dropout uses the default generators."""

    rng_tracker = None

    def __init__(self, module: nn.Module):
        self.module = module

    def use_weight_grad_store(self, store: WeightGradStore) -> None:
        attach_weight_grad_store(self.module, store)

    def layer_boundaries(self, cut: Cut) -> AbstractContextManager:
        return nullcontext()

    def in_flight_hook(self, hook: InFlightHook) -> AbstractContextManager:
        return nullcontext()


def as_pipeline_chunk(module: nn.Module) -> PipelineChunk:
    """``module`` itself when it implements :class:`PipelineChunk`, else a :class:`ModuleChunk`."""
    return module if isinstance(module, PipelineChunk) else ModuleChunk(module)


def attach_weight_grad_stores(chunks) -> list[WeightGradStore]:
    """One new store per chunk (so a chunk's ``W`` actions follow that chunk's ``B`` actions),
    given to the chunk; returns them in chunk order."""
    stores = []
    for chunk in chunks:
        store = WeightGradStore()
        as_pipeline_chunk(chunk).use_weight_grad_store(store)
        stores.append(store)
    return stores
