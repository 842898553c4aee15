"""DualPipeV: DeepSeek-V3's DualPipe folded into one direction on a V placement.

DualPipe (DeepSeek-AI 2024, section 3.2.1) feeds microbatches from both ends of the pipeline and
pairs the forward of one microbatch with the backward of another, so that each one's expert
all-to-alls travel while the other computes. Its V-shaped form ("cut in half", as in the DualPipe
repository and in ``torch.distributed.pipelining.ScheduleDualPipeV``) keeps one direction and
places two stages per rank in a V (rank ``r`` holds stages ``r`` and ``2p-1-r``, as ZBV): the
forward runs down the ranks on the first stages and back up on the second ones.

Here it is an order of paratron's own actions, ``F``, ``B``, ``W``, ``BW`` and ``FB`` pairs
(:mod:`.actions`), so the validator proves it, the simulator costs it and the runtime runs it
like any other list. Per rank r, with ``c0 = r`` (the rank's first stage) and ``c1 = 2p-1-r``:

====  ==================  =============  =============================================
step  repeat              actions        why
====  ==================  =============  =============================================
1     ``2(p-r-1)``        F c0           fill the way down
2     ``r+1``             F c0, F c1     the turn of the V reaches this rank
3     ``p-r-1``           B c1, W, F c1  zero-bubble warm-up: weight grads deferred
4     ``m-2p+r+1``        FB(F c0, BW    steady state: every forward paired with a
                          c1), FB(F c1,  backward (rank p-1 runs its first pair as two
                          BW c0)         plain actions, so its first grad leaves sooner)
5     ``p-r-1``           BW c1,         the last forwards of c1
                          FB(F c1, BW c0)
6     ``r+1``             c1, c0         backwards; from the middle one on (c1 first on
                                         odd ranks) input grads only, ``B``
7     ``p-r-1``           W, c0          the remaining backwards of c0
8     ``r+1``             W              the deferred weight grads
====  ==================  =============  =============================================

A ``W`` runs the oldest deferred weight grad of the rank (a queue over both stages, as ZB-H1's
store). Microbatches enter each stage in order, and backwards leave each stage in order. This is
the published order of PyTorch's ``ScheduleDualPipeV`` (torch 2.8+), rebuilt from its steps; the
test ``tests/test_pipeline_dualpipev.py`` compares both for small cases written out by hand.
"""

from __future__ import annotations

from collections import deque

from .actions import FB, Action, B, BW, F, W
from .placement import v_placement
from .schedules import with_p2p


def check_dualpipev(p: int, m: int, v: int) -> None:
    """Raise ``ValueError`` with the rule unless ``v == 2`` and ``m >= 2p``."""
    if v != 2:
        raise ValueError(f"schedule 'dualpipev' places exactly 2 chunks per rank in a V: virtual stages "
                         f"v={v} must be 2")
    if m < 2 * p:
        raise ValueError(f"schedule 'dualpipev' needs at least as many microbatches as stages: m={m} < 2p={2 * p} "
                         "(its warm-up fills both chunks of every rank)")


class _RankOrder:
    """One rank's compute order being written: next microbatch per (kind, stage) and the queue of
    deferred weight grads."""

    def __init__(self) -> None:
        self.acts: list[Action] = []
        self.next_f: dict[int, int] = {}
        self.next_b: dict[int, int] = {}
        self.deferred: deque[Action] = deque()

    def forward(self, stage: int) -> Action:
        mb = self.next_f.get(stage, 0)
        self.next_f[stage] = mb + 1
        return F(mb, stage)

    def backward(self, stage: int, split: bool) -> Action:
        """The next backward of ``stage``: ``B`` (its ``W`` queued) when ``split``, else ``BW``."""
        mb = self.next_b.get(stage, 0)
        self.next_b[stage] = mb + 1
        if not split:
            return BW(mb, stage)
        self.deferred.append(W(mb, stage))
        return B(mb, stage)

    def add(self, *acts: Action) -> None:
        self.acts.extend(acts)

    def weight(self) -> None:
        if self.deferred:
            self.acts.append(self.deferred.popleft())

    def pair(self, f_stage: int, b_stage: int) -> None:
        f = self.forward(f_stage)
        self.add(FB(f, self.backward(b_stage, split=False)))


def dualpipev_order(p: int, m: int, r: int) -> list[Action]:
    """Compute-only order of rank ``r`` (steps 1-8 of the module docstring)."""
    c0, c1 = v_placement(p, 2)[r]
    o = _RankOrder()
    for _ in range(2 * (p - r - 1)):
        o.add(o.forward(c0))
    for _ in range(r + 1):
        o.add(o.forward(c0))
        o.add(o.forward(c1))
    for _ in range(p - r - 1):
        o.add(o.backward(c1, split=True))
        o.weight()
        o.add(o.forward(c1))
    for i in range(m - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # as published: the first grad leaves before this forward runs
            o.add(o.forward(c0))
            o.add(o.backward(c1, split=False))
        else:
            o.pair(c0, c1)
        o.pair(c1, c0)
    for _ in range(p - r - 1):
        o.add(o.backward(c1, split=False))
        o.pair(c1, c0)
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        o.add(o.backward(c1, split))
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        o.add(o.backward(c0, split))
    for _ in range(p - r - 1):
        o.weight()
        o.add(o.backward(c0, split))
    for _ in range(r + 1):
        o.weight()
    while o.deferred:  # none left for m >= 2p; kept so no weight grad can be dropped
        o.weight()
    return o.acts


def dualpipev(p: int, m: int, v: int = 2) -> list[list[Action]]:
    """DualPipeV's action lists for ``p`` ranks and ``m`` microbatches (``v`` must be 2).

    Peak in-flight activations (:func:`~paratron.pipeline.actions.activation_peak`, an ``FB``
    counting its forward first) ``2p + 1`` chunk activations on rank 0, against ZBV's ``2p``.

    Raises:
        ValueError: ``v != 2`` or ``m < 2p`` (:func:`check_dualpipev`).
    """
    check_dualpipev(p, m, v)
    return with_p2p([dualpipev_order(p, m, r) for r in range(p)])
