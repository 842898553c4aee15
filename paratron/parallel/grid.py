"""Rank grids: which global ranks form each process group, computed without any process.

A layout of ``world`` ranks is a reshaped ``arange(world)``. The rank order string
(default Megatron's ``"tp-cp-ep-dp-pp"``) lists the axes from the fastest-varying to the
slowest, so with the default TP neighbours are adjacent ranks (and stay inside a node).

The dense grid has axes tp, cp, dp, pp (ep is ignored there: dense layers are not split over
experts). The expert grid has axes expert-tp, ep, expert-dp, pp, where
``expert_dp = world / (expert_tp * ep * pp)``; its pp groups must equal the dense grid's, so that
one pipeline carries both dense and expert layers.

Source: the rank generator of Megatron-LM (``megatron/core/parallel_state.py``,
``RankGenerator``), re-derived here as pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
AXES = ("tp", "cp", "ep", "dp", "pp")
GROUP_KINDS = (
    "tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp", "tp_dp_cp", "world", "embedding",
    "position_embedding", "expert_tp", "ep", "expert_dp", "expert_tp_ep",
)
"""Every group kind of a :class:`RankGrid`, in the order process groups are created."""


class LayoutError(ValueError):
    """A parallel layout that cannot be built; the message names the field and the rule."""


def parse_order(order: str) -> list[str]:
    """Split ``"tp-cp-ep-dp-pp"`` into axis names; each of the five axes exactly once."""
    axes = [a.strip() for a in order.split("-")]
    if sorted(axes) != sorted(AXES):
        raise LayoutError(
            f"parallel.order={order!r} must name each of {'-'.join(AXES)} exactly once, "
            "fastest-varying first"
        )
    return axes


def axis_groups(world: int, sizes: dict[str, int], order: list[str], dims: list[str]) -> list[list[int]]:
    """Groups of ranks that differ only along ``dims``.

    Args:
        world: number of ranks; must equal the product of ``sizes`` over ``order``.
        sizes: size of every axis named in ``order``.
        order: axes from fastest- to slowest-varying.
        dims: the axes that vary inside one group.

    Returns:
        A list of groups, each a list of global ranks; inside a group the axis that comes first in
        ``order`` varies fastest. Groups are sorted by their first rank.
    """
    shape = [sizes[a] for a in reversed(order)]  # numpy: last axis varies fastest
    if prod(shape) != world:
        raise LayoutError(f"the sizes {sizes} multiply to {prod(shape)}, not the world size {world}")
    mesh = np.arange(world).reshape(shape)
    rev = list(reversed(order))
    keep = [i for i, a in enumerate(rev) if a not in dims]
    vary = [i for i, a in enumerate(rev) if a in dims]
    group_size = prod(sizes[a] for a in dims)
    rows = np.transpose(mesh, keep + vary).reshape(-1, group_size)
    return sorted((row.tolist() for row in rows), key=lambda g: g[0])


@dataclass(frozen=True)
class RankGrid:
    """Every process group of one layout, as lists of global ranks.

    ``dp`` is derived as ``world / (tp * cp * pp)``; the expert grid uses ``expert_tp`` (default 1)
    and ``ep``, with ``expert_dp = world / (expert_tp * ep * pp)``.
    """

    world: int
    tp: int
    cp: int
    ep: int
    pp: int
    dp: int
    expert_tp: int
    expert_dp: int
    order: tuple[str, ...]
    groups: dict[str, list[list[int]]]

    def group_of(self, kind: str, rank: int) -> list[int] | None:
        """The group of ``kind`` that holds ``rank``, or None when ``rank`` is in none of them
        (only possible for ``embedding`` and ``position_embedding``)."""
        for g in self.groups[kind]:
            if rank in g:
                return g
        return None

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each dense and expert axis."""
        out = {}
        for kind in ("tp", "cp", "dp", "pp", "expert_tp", "ep", "expert_dp"):
            out[kind] = self.group_of(kind, rank).index(rank)
        return out


def check_grid(world: int, tp: int = 1, cp: int = 1, ep: int = 1, pp: int = 1, expert_tp: int = 1,
               order: str = DEFAULT_ORDER) -> tuple[list[str], int, int]:
    """Every rule a layout's grid must satisfy, checked without building a group (constant time,
    whatever the world size: the config validator runs it on each of the planner's candidates).

    Returns:
        (axes of ``order``, dp, expert_dp).

    Raises:
        LayoutError: naming the rule broken (the same errors :func:`build_grid` raises).
    """
    for name, v in (("tensor", tp), ("context", cp), ("expert", ep), ("pipeline", pp),
                    ("expert_tensor", expert_tp)):
        if not isinstance(v, int) or v < 1:
            raise LayoutError(f"parallel.{name}={v!r} must be a positive integer")
    axes = parse_order(order)
    if world % (tp * cp * pp):
        raise LayoutError(
            f"world size {world} is not divisible by parallel.tensor*parallel.context*parallel.pipeline "
            f"= {tp}*{cp}*{pp} = {tp * cp * pp}"
        )
    dp = world // (tp * cp * pp)
    if world % (expert_tp * ep * pp):
        raise LayoutError(
            f"world size {world} is not divisible by parallel.expert_tensor*parallel.expert*"
            f"parallel.pipeline = {expert_tp}*{ep}*{pp} = {expert_tp * ep * pp}"
        )
    expert_dp = world // (expert_tp * ep * pp)
    dense_stride = pp_stride(axes, {"tp": tp, "cp": cp, "ep": 1, "dp": dp})
    expert_stride = pp_stride([a for a in axes if a != "cp"], {"tp": expert_tp, "ep": ep, "dp": expert_dp})
    if pp > 1 and dense_stride != expert_stride:
        raise LayoutError(
            f"parallel.order={order!r} gives the expert grid other pipeline groups than the dense "
            "grid; put pp slowest (last) so both grids share one pipeline"
        )
    return axes, dp, expert_dp


def pp_stride(order: list[str], sizes: dict[str, int]) -> int:
    """Rank distance between pipeline neighbours: the product of the sizes of the axes that vary
    faster than pp. A rank's pp group is ``{r + (k - c) stride : k < pp}`` (``c`` its pp index), so
    two grids of one world and one pp > 1 have the same pp groups exactly when their strides agree
    (rank 0's group is ``{0, stride, ..., (pp - 1) stride}``)."""
    return prod(sizes[a] for a in order[:order.index("pp")])


def build_grid(
    world: int,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    pp: int = 1,
    expert_tp: int = 1,
    order: str = DEFAULT_ORDER,
) -> RankGrid:
    """Compute every group of a layout. Raises :class:`LayoutError` naming the rule broken
    (:func:`check_grid`)."""
    axes, dp, expert_dp = check_grid(world, tp, cp, ep, pp, expert_tp, order)

    dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    g: dict[str, list[list[int]]] = {}

    def dense(*dims: str) -> list[list[int]]:
        return axis_groups(world, dense_sizes, axes, list(dims))

    g["tp"] = dense("tp")
    g["cp"] = dense("cp")
    g["dp"] = dense("dp")
    g["pp"] = dense("pp")
    g["mp"] = dense("tp", "pp")
    g["tp_cp"] = dense("tp", "cp")
    g["dp_cp"] = dense("dp", "cp")
    g["tp_dp_cp"] = dense("tp", "dp", "cp")
    g["world"] = [list(range(world))]
    g["embedding"] = [sorted({p[0], p[-1]}) for p in g["pp"]]
    g["position_embedding"] = [[p[0]] for p in g["pp"]]

    # Expert grid: cp folds into expert-dp (Megatron does the same), tp becomes expert-tp.
    expert_axes = [a for a in axes if a != "cp"]
    expert_sizes = {"tp": expert_tp, "ep": ep, "dp": expert_dp, "pp": pp}

    def expert(*dims: str) -> list[list[int]]:
        return axis_groups(world, expert_sizes, expert_axes, list(dims))

    g["expert_tp"] = expert("tp")
    g["ep"] = expert("ep")
    g["expert_dp"] = expert("dp")
    g["expert_tp_ep"] = expert("tp", "ep")
    return RankGrid(world, tp, cp, ep, pp, dp, expert_tp, expert_dp, tuple(axes), g)
