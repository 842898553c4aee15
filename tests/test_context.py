"""The parallel context built on 8 real gloo ranks agrees with the pure rank grid."""

import os

import torch

from paratron.parallel.context import GROUP_KINDS, ParallelContext
from paratron.parallel.grid import build_grid
from paratron.local_ranks import RankFailure, RankTimeout, run_ranks


def _membership(tp, pp, ep):
    ctx = ParallelContext.build(tp=tp, pp=pp, ep=ep)
    out = {k: getattr(ctx, k).ranks for k in GROUP_KINDS}
    # A collective on each group proves the process group really holds those ranks.
    for kind in ("tp", "dp", "pp", "ep", "expert_dp"):
        t = torch.tensor([float(ctx.rank)])
        getattr(ctx, kind).all_reduce(t)
        out[kind + "_sum"] = t.item()
    return out


def test_context_matches_grid_on_8_ranks():
    results = run_ranks(_membership, 8, 2, 2, 2, timeout=120)
    grid = build_grid(8, tp=2, pp=2, ep=2)
    for rank, got in enumerate(results):
        for kind in GROUP_KINDS:
            want = grid.group_of(kind, rank) or []
            assert got[kind] == want, (rank, kind)
        for kind in ("tp", "dp", "pp", "ep", "expert_dp"):
            assert got[kind + "_sum"] == sum(grid.group_of(kind, rank))


def test_single_context_has_size_one_groups():
    ctx = ParallelContext.single()
    assert all(getattr(ctx, k).size == 1 for k in GROUP_KINDS)
    t = torch.ones(3)
    assert ctx.tp.all_reduce(t) is None and torch.equal(t, torch.ones(3))
    assert ctx.is_first_stage and ctx.is_last_stage


def test_groups_are_typed_fields():
    """Every group kind is a declared ``Group`` field (seen by IDEs and type checkers), and the
    names match the grid's group kinds one for one."""
    import dataclasses

    from paratron.parallel.comm import Group

    fields = {f.name: f.type for f in dataclasses.fields(ParallelContext)}
    assert all(fields.get(k) in (Group, "Group") for k in GROUP_KINDS)
    assert set(build_grid(1).groups) == set(GROUP_KINDS)
    ctx = ParallelContext.single()
    assert ctx.group("expert_dp") is ctx.expert_dp
    assert not hasattr(ParallelContext, "__getattr__")


def _fail_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return dist.get_rank()


def _hang_on_rank_0():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        import time

        time.sleep(60)
    return dist.get_rank()


def test_harness_reports_failing_rank_traceback():
    try:
        run_ranks(_fail_on_rank_1, 2, timeout=60)
    except RankFailure as e:
        assert "rank 1 of 2 failed" in str(e) and "boom on purpose" in str(e)
    else:
        raise AssertionError("RankFailure not raised")


def test_harness_names_hanging_ranks():
    try:
        run_ranks(_hang_on_rank_0, 2, timeout=3)
    except RankTimeout as e:
        assert "ranks [0] of 2 did not finish" in str(e)
    else:
        raise AssertionError("RankTimeout not raised")


def _count_run(marker_dir):
    import os

    import torch.distributed as dist

    open(os.path.join(marker_dir, f"ran-{dist.get_rank()}-{os.getpid()}"), "w").close()
    return dist.get_rank()


def _rendezvous_failing(monkeypatch, marker_dir, times):
    """init_process_group raises on rank 1 for its first ``times`` calls (counted in files, since
    every launch forks fresh ranks), as gloo's full-mesh connect does under load."""
    import os

    import torch.distributed as dist

    real = dist.init_process_group

    def flaky(*a, **kw):
        if kw.get("rank") == 1:
            done = len([f for f in os.listdir(marker_dir) if f.startswith("refused")])
            if done < times:
                open(os.path.join(marker_dir, f"refused-{done}"), "w").close()
                raise RuntimeError("Gloo connectFullMesh failed with ... Connection closed by peer")
        return real(*a, **kw)

    monkeypatch.setattr(dist, "init_process_group", flaky)


def test_harness_repeats_a_failed_rendezvous_before_any_rank_runs(tmp_path, monkeypatch):
    _rendezvous_failing(monkeypatch, str(tmp_path), times=1)
    assert run_ranks(_count_run, 2, str(tmp_path), timeout=60) == [0, 1]
    # fn ran once per rank, in the second launch only: rank 0 waited at the barrier in the first.
    assert sorted(f.split("-")[1] for f in os.listdir(tmp_path) if f.startswith("ran")) == ["0", "1"]


def test_harness_reports_a_rendezvous_that_keeps_failing(tmp_path, monkeypatch):
    from paratron.local_ranks import RENDEZVOUS_ATTEMPTS

    _rendezvous_failing(monkeypatch, str(tmp_path), times=RENDEZVOUS_ATTEMPTS)
    try:
        run_ranks(_count_run, 2, str(tmp_path), timeout=60)
    except RankFailure as e:
        assert "connectFullMesh" in str(e)
    else:
        raise AssertionError("RankFailure not raised")
    assert not [f for f in os.listdir(tmp_path) if f.startswith("ran")]


def _layout_line(moe):
    from paratron.rules import load_config
    from paratron.training.groups import context_for

    cfg = load_config(None, ["parallel.context=2"] + (["model.num_experts=2"] if moe else []))
    return context_for(cfg).describe()


def test_layout_line_names_the_expert_grid_only_for_moe():
    """A dense CP2 run has no expert groups: its line must not show expert_dp=2 (CP folded in)."""
    dense, moe = run_ranks(_layout_line, 2, False, timeout=120)[0], run_ranks(_layout_line, 2, True, timeout=120)[0]
    assert dense == "world=2 tp=1 cp=2 pp=1 dp=1 order=tp-cp-ep-dp-pp", dense
    assert moe == "world=2 tp=1 cp=2 pp=1 dp=1 ep=1 expert_tp=1 expert_dp=2 order=tp-cp-ep-dp-pp", moe
