"""What one rank's action list asks of the runtime, worked out once before any tensor moves.

:func:`plan_run` reads a checked action list (:mod:`.validate`) and returns a frozen
:class:`RunPlan`: the order of its steps (compute actions and p2p batches), which batch's
receives are posted when, which chunk runs which stage, which backward is the last of each
chunk (when gradient reduction may start), which forwards are recomputed by an ``R`` and which
microbatches have their backward cut into layer segments (the backward half of an ``FB`` pair,
:mod:`.overlap`). The runtime (:mod:`.runtime`) only executes it; nothing here touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from .actions import (Action, batches, forward_only as strip_backward, halves, last_backward_actions, recomputed,
                      stages_of)

Key = tuple[int, int]
"""(microbatch, stage)."""


@dataclass(frozen=True)
class RunPlan:
    """One rank's part of one pipelined step, as the runtime executes it.

    Attributes:
        steps: the list in execution order: a compute action alone, or a maximal run of p2p
            actions (one ``batch_isend_irecv`` batch).
        next_p2p: step index of a p2p batch -> index of the next p2p batch (its receives are
            posted when the first is reached).
        first_p2p: index of the first p2p batch (its receives are posted before the first step),
            or None.
        local: stage -> local chunk index (chunks in ascending stage order).
        last_stage: the model's last stage (``pp * chunks - 1``); its forward returns the loss.
        last_backward: stage -> the action (``B``, ``W``, ``BW`` or an ``FB`` holding one) after
            which that stage's chunk gets no more grads this step; empty when forward-only.
        recomputed: (microbatch, stage) whose ``F`` keeps only its input and is run again by an ``R``.
        segmented: (microbatch, stage) whose backward is the backward half of an ``FB`` pair.
        forward_only: evaluation: forwards without autograd, no backward or grad sends.
    """

    steps: tuple[tuple[Action, ...], ...]
    next_p2p: Mapping[int, int]
    first_p2p: int | None
    local: Mapping[int, int]
    last_stage: int
    last_backward: Mapping[int, Action]
    recomputed: frozenset[Key]
    segmented: frozenset[Key]
    forward_only: bool

    def is_last_backward(self, a: Action) -> list[int]:
        """The local chunks whose last backward of the step is ``a`` (ascending; usually none)."""
        return sorted({self.local[h.stage] for h in halves(a) if self.last_backward.get(h.stage) == a})


def plan_run(actions: list[Action], num_chunks: int, pp_size: int, num_microbatches: int, *,
             forward_only: bool = False) -> RunPlan:
    """The :class:`RunPlan` of one rank's action list.

    Args:
        actions: this rank's list (``build_schedule(...)[ctx.pp.rank]``), checked by the validator.
        num_chunks: the model chunks this rank holds; the model has ``pp_size * num_chunks`` stages.
        pp_size: pipeline ranks.
        num_microbatches: microbatches the caller holds.
        forward_only: plan the forward-only (evaluation) run of the list.

    Raises:
        ValueError: the list runs another number of stages than ``num_chunks``, or uses a
            microbatch index ``>= num_microbatches``.
    """
    stages = stages_of(actions)
    if len(stages) != num_chunks:
        raise ValueError(f"the action list runs stages {stages} but {num_chunks} model chunks were given")
    if actions and max(a.microbatch for a in actions) >= num_microbatches:
        raise ValueError(f"the action list uses microbatch {max(a.microbatch for a in actions)} but only "
                         f"{num_microbatches} microbatches were given")
    steps = tuple(tuple(step) for step in batches(strip_backward(actions) if forward_only else actions))
    p2p_at = [i for i, step in enumerate(steps) if step[0].is_p2p and not step[0].is_encoder]  # encoder: its own
    training = not forward_only
    return RunPlan(
        steps=steps,
        next_p2p=MappingProxyType(dict(zip(p2p_at, p2p_at[1:]))),
        first_p2p=p2p_at[0] if p2p_at else None,
        local=MappingProxyType({s: c for c, s in enumerate(stages)}),
        last_stage=pp_size * num_chunks - 1,
        last_backward=MappingProxyType(last_backward_actions(actions) if training else {}),
        recomputed=frozenset(recomputed(actions) if training else ()),
        segmented=frozenset((h.microbatch, h.stage) for a in actions if training and a.kind == "FB"
                            for h in halves(a)[1:]),
        forward_only=forward_only)
