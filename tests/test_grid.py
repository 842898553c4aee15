"""Group membership for world 8, checked against rank orders written out by hand."""

import pytest

import itertools

from paratron.parallel.grid import AXES, LayoutError, axis_groups, build_grid, check_grid


def singles(n):
    return [[r] for r in range(n)]


def test_tp2_pp2_dp2():
    # default order tp-cp-ep-dp-pp: rank = tp + 2*dp + 4*pp
    g = build_grid(8, tp=2, pp=2).groups
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["cp"] == singles(8)
    assert g["tp_cp"] == g["tp"]
    assert g["dp_cp"] == g["dp"]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["position_embedding"] == [[0], [1], [2], [3]]
    assert g["tp_dp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_tp2_cp2_pp2():
    # rank = tp + 2*cp + 4*pp, dp = 1
    grid = build_grid(8, tp=2, cp=2, pp=2)
    g = grid.groups
    assert grid.dp == 1
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["dp"] == singles(8)
    assert g["tp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g["dp_cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_tp2_ep2_pp2_expert_grid():
    # dense: rank = tp + 2*dp + 4*pp; expert (expert_tp=1): rank = ep + 2*edp + 4*pp
    grid = build_grid(8, tp=2, ep=2, pp=2)
    g = grid.groups
    assert (grid.dp, grid.expert_dp) == (2, 2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert_tp"] == singles(8)
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["expert_dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # with expert-tp 2: rank = etp + 2*ep + 4*pp, expert_dp = 1
    grid = build_grid(8, tp=2, ep=2, pp=2, expert_tp=2)
    g = grid.groups
    assert g["expert_tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["expert_dp"] == singles(8)
    assert g["expert_tp_ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_tp1_pp4_dp2():
    # rank = dp + 2*pp
    g = build_grid(8, pp=4).groups
    assert g["tp"] == singles(8)
    assert g["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["pp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["mp"] == g["pp"]
    assert g["embedding"] == [[0, 6], [1, 7]]
    assert g["position_embedding"] == [[0], [1]]


def test_custom_order_pp_fastest():
    # order pp-tp-cp-ep-dp: rank = pp + 2*tp + 4*dp
    g = build_grid(8, tp=2, pp=2, order="pp-tp-cp-ep-dp").groups
    assert g["pp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["tp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_every_rank_in_exactly_one_group():
    grid = build_grid(8, tp=2, pp=2, ep=2)
    for kind, groups in grid.groups.items():
        flat = sorted(r for grp in groups for r in grp)
        if kind == "embedding":
            assert set(flat) <= set(range(8))
        elif kind == "position_embedding":
            assert len(flat) == 4
        else:
            assert flat == list(range(8)), kind


@pytest.mark.parametrize("kw,msg", [
    (dict(tp=3), "world size 8 is not divisible by parallel.tensor*parallel.context*parallel.pipeline"),
    (dict(tp=0), "parallel.tensor=0 must be a positive integer"),
    (dict(order="tp-cp-dp-pp"), "must name each of"),
    (dict(ep=3), "parallel.expert_tensor*parallel.expert*parallel.pipeline"),
])
def test_layout_errors(kw, msg):
    with pytest.raises(LayoutError, match=msg.replace("*", r"\*")):
        build_grid(8, **kw)


@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2, pp=2), dict(cp=2, ep=4, pp=2), dict(tp=2, cp=2, pp=2, expert_tp=2),
                                   dict(ep=2, pp=4), dict(tp=4, ep=2, pp=2)])
def test_check_grid_pp_rule_matches_the_groups(sizes):
    # check_grid decides "both grids share the pp groups" from strides, without groups: for every
    # rank order it must agree with comparing the groups themselves.
    world, refused = 16, 0
    for perm in itertools.permutations(AXES):
        order = "-".join(perm)
        _, dp, edp = check_grid(world, order="tp-cp-ep-dp-pp", **sizes)
        tp, cp, ep, pp, etp = (sizes.get(k, 1) for k in ("tp", "cp", "ep", "pp", "expert_tp"))
        dense = axis_groups(world, {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}, list(perm), ["pp"])
        expert = axis_groups(world, {"tp": etp, "ep": ep, "dp": edp, "pp": pp},
                             [a for a in perm if a != "cp"], ["pp"])
        try:
            check_grid(world, order=order, **sizes)
            same = True
        except LayoutError:
            same, refused = False, refused + 1
        assert same == (sorted(dense) == sorted(expert)), order
    assert 0 < refused < 120  # both outcomes are exercised
