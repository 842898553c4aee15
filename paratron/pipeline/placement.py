"""Placements: which virtual pipeline stages (model chunks) each pipeline rank holds.

A placement is a function ``(p, v) -> list[list[int]]``: for each pipeline rank, its stages in
ascending order (local chunk ``c`` of rank ``r`` is ``placement(p, v)[r][c]``). Stages are numbered
in model order, ``0 .. p*v-1``.
"""

from __future__ import annotations

from typing import Callable

Placement = Callable[[int, int], list[list[int]]]


def loop_placement(p: int, v: int) -> list[list[int]]:
    """Megatron's interleaved placement: rank ``r`` holds stages ``r, r+p, r+2p, ...``
    (Narayanan et al. 2021, section 2.2). With ``v=1`` this is the plain one-stage-per-rank split."""
    return [[c * p + r for c in range(v)] for r in range(p)]


def v_placement(p: int, v: int) -> list[list[int]]:
    """ZBV's V shape: rank ``r`` holds stages ``r`` and ``2p-1-r`` (Qi et al. 2023, section 6), so
    the first and the last stage both live on rank 0 and the turn of the V stays on rank ``p-1``.

    Raises:
        ValueError: ``v != 2``.
    """
    if v != 2:
        raise ValueError(f"the V placement holds exactly 2 chunks per rank; got virtual stages v={v}")
    return [[r, 2 * p - 1 - r] for r in range(p)]


def rank_of_stage(placement: list[list[int]]) -> dict[int, int]:
    """Invert a placement table: stage -> pipeline rank."""
    return {s: r for r, stages in enumerate(placement) for s in stages}
