"""Executing an ``FB`` pair (:mod:`.overlap`): one microbatch's forward with another's backward.

DeepSeek-V3 (DeepSeek-AI 2024, section 3.2.1) overlaps the all-to-alls of each half with the
other half's compute. Here:

* The backward of a paired microbatch was cut at its layer boundaries during its forward
  (:class:`LayerCuts`; the chunk calls the cut before each layer and before the head,
  :meth:`~paratron.pipeline.chunk.PipelineChunk.layer_boundaries`), so it runs as one autograd
  call per segment: the head on the last stage, else the last layer, first; the embedding last
  on the first stage.
* :func:`run_fb_pair` runs the first backward segment, then the forward, whose MoE dispatchers
  call the pair's hook after launching each all-to-all asynchronously
  (:meth:`~paratron.pipeline.chunk.PipelineChunk.in_flight_hook`): the hook runs the next
  backward segment, then waits for the exchange. What is left of the backward runs after the
  forward returns.

Both halves' collectives are issued in the same order on every rank of a group (the same list,
the same model), so they match.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from .actions import Action
from .chunk import PipelineChunk

Key = tuple[int, int]
"""(microbatch, stage)."""


class LayerCuts:
    """The cut points of the forwards whose backward will run in segments, by (microbatch, stage)."""

    def __init__(self) -> None:
        self.cuts: dict[Key, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def cut_for(self, key: Key) -> Callable[[torch.Tensor], torch.Tensor]:
        """The cut for the forward of ``key``: the activation becomes a fresh leaf, the next
        segment's input, whose ``.grad`` links the two segments' backwards."""
        cuts = self.cuts.setdefault(key, [])

        def cut(t: torch.Tensor) -> torch.Tensor:
            if not (torch.is_grad_enabled() and t.requires_grad and t.grad_fn is not None):
                return t
            leaf = t.detach().requires_grad_(True)
            cuts.append((t, leaf))
            return leaf

        return cut

    def pieces(self, key: Key, out: torch.Tensor, grad: torch.Tensor | None) -> list[tuple]:
        """The backward of ``key`` as ``(tensor, grad)`` per segment, last segment first. A grad
        after the first is the cut's leaf: its ``.grad`` once the later segment has run
        (:func:`leaf_grad`)."""
        return [(out, grad)] + [(t, leaf) for t, leaf in reversed(self.cuts.pop(key, []))]


def leaf_grad(leaf: torch.Tensor) -> torch.Tensor:
    """The grad that reached ``leaf`` (summed over its uses), zeros when none did."""
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


class Segments:
    """The backward half of an ``FB`` pair, advanced one segment per :meth:`step`; each segment
    is recorded as a ``backward`` compute interval under the backward's (microbatch, stage)."""

    def __init__(self, segments: Iterator[None], rec, scope: Key):
        self.segments, self.rec, self.scope = segments, rec, scope
        self.busy = self.done = False
        self.end = 0.0  # perf_counter() when the last segment finished

    def step(self) -> None:
        if self.done:
            return
        self.busy = True
        outer = None
        if self.rec is not None:
            outer, self.rec.scope = self.rec.scope, self.scope
        try:
            if self.rec is None:
                self.done = next(self.segments, self) is self
            else:
                with self.rec.compute("backward"):
                    self.done = next(self.segments, self) is self
        finally:
            self.busy = False
            if self.rec is not None:
                self.rec.scope = outer
        self.end = time.perf_counter()


def run_fb_pair(f: Action, b: Action, chunk: PipelineChunk, forward: Callable[[Action], None],
                backward_segments: Iterator[None], rec) -> tuple[float, float, float, float]:
    """Run the forward ``f`` interleaved with the backward ``b`` (``backward_segments`` yields
    between its segments); ``chunk`` runs ``f``, ``rec`` is the interval recorder or None.

    Returns:
        ``perf_counter()`` at the start and end of the forward, then of the backward.
    """
    backward = Segments(backward_segments, rec, (b.microbatch, b.stage))
    b_start = time.perf_counter()
    backward.step()

    def while_in_flight(what: str, wait: Callable[[], None]) -> None:
        if backward.busy:  # a recompute inside a backward segment runs a forward: no nesting
            return
        backward.step()
        wait()

    f_start = time.perf_counter()
    with chunk.in_flight_hook(while_in_flight):
        forward(f)
    f_end = time.perf_counter()
    while not backward.done:
        backward.step()
    return f_start, f_end, b_start, backward.end
