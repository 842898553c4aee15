"""Re-made process groups (paratron/elastic/regroup.py), under gloo: the same four ranks re-made
into a new generation keep a working DP x PP context and the old groups are dead; a rank that
leaves makes the survivors' collective fail (not hang), and they re-make a smaller world and
keep computing."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from paratron.elastic.regroup import abort_world, connect_store, rebuild_context, remake_world
from paratron.local_ranks import run_ranks
from paratron.parallel.comm import GroupNotCreated
from paratron.parallel.context import ParallelContext

TIMEOUT_S = 60.0


@pytest.fixture
def job_store():
    """The job's store, served by this (the test) process as the elastic launcher serves it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=TIMEOUT_S),
                          wait_for_workers=False)
    yield "127.0.0.1", store.port
    del store


def _sums(ctx) -> dict:
    """The all-reduced rank ids over dp, pp and world."""
    out = {}
    for kind in ("dp", "pp", "world"):
        t = torch.tensor([float(ctx.rank)])
        ctx.group(kind).all_reduce(t)
        out[kind] = t.item()
    return out


def _same_members(addr, port):
    old = ParallelContext.build(pp=2)  # dp2 x pp2
    before = _sums(old)
    store = connect_store(TIMEOUT_S, addr, port)
    remake_world(store, 1, dist.get_rank(), 4, TIMEOUT_S, release=[old])
    new = rebuild_context(old)
    after = _sums(new)
    try:  # the old groups were released: a collective on them names the group
        old.dp.all_reduce(torch.ones(1))
        refused = ""
    except GroupNotCreated as e:
        refused = str(e)
    return before, after, new.grid.groups, old.grid.groups, refused


def test_remake_world_same_members_keeps_the_grid(job_store):
    results = run_ranks(_same_members, 4, *job_store, timeout=TIMEOUT_S * 2)
    for before, after, new_groups, old_groups, refused in results:
        assert before == after
        assert new_groups == old_groups
        assert "all_reduce on group 'dp'" in refused
    # dp groups of the default order (tp-cp-ep-dp-pp) are {0,1} and {2,3}; pp {0,2} and {1,3}
    assert [r[1]["dp"] for r in results] == [1.0, 1.0, 5.0, 5.0]
    assert [r[1]["pp"] for r in results] == [2.0, 4.0, 2.0, 4.0]
    assert all(r[1]["world"] == 6.0 for r in results)


def _one_leaves(addr, port):
    """Rank 2 leaves (while 0 and 1 wait for it in a collective); ranks 0 and 1 find their next world collective failed and re-make a world
    of two, with the pipeline degree of the old context (1) and dp = 2."""
    old = ParallelContext.build()
    rank = dist.get_rank()
    if rank == 2:  # aborting closes its connections, as a process's death does
        time.sleep(0.5)
        abort_world()
        return {"left": True}
    t0 = time.monotonic()
    try:
        old.world.all_reduce(torch.ones(1))
        failed = None
    except Exception as e:  # noqa: BLE001 - gloo raises on a peer's closed connection
        failed = type(e).__name__
    detect_s = time.monotonic() - t0
    store = connect_store(TIMEOUT_S, addr, port)
    remake_world(store, 1, rank, 2, TIMEOUT_S, release=[old])
    new = rebuild_context(old)
    t = torch.tensor([float(rank + 1)])
    new.dp.all_reduce(t)
    return {"failed": failed, "detect_s": detect_s, "dp": new.dp.size, "sum": t.item()}


def test_survivors_of_a_leaving_rank_fail_fast_and_remake_a_smaller_world(job_store):
    results = run_ranks(_one_leaves, 3, *job_store, timeout=TIMEOUT_S * 2)
    assert results[2] == {"left": True}
    for r in results[:2]:
        assert r["failed"] is not None  # raised, not returned: the collective could not complete
        assert r["detect_s"] < TIMEOUT_S  # and not by the collective timeout: the connection closed
        assert (r["dp"], r["sum"]) == (2, 3.0)


def test_remake_world_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"rank 3 is not in \[0, 2\)"):
        remake_world(None, 1, 3, 2, 1.0)


def test_connect_store_needs_an_address(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        connect_store(1.0)


def _cascade(addr, port):
    """Rank 2 leaves while rank 1 waits to receive from it; ranks 0 and 3 wait to receive from
    rank 1 (alive). Rank 1's receive fails on the closed connection; its abort in
    ``remake_world`` closes its own connections, so 0 and 3 fail too, without the timeout. The
    three survivors then re-make a world of three (ranks 0, 1, 3 -> 0, 1, 2)."""
    old = ParallelContext.build()
    rank = dist.get_rank()
    pairs = {r: dist.new_group(list(r)) for r in ((0, 1), (1, 2), (1, 3))}  # collective: all ranks
    if rank == 2:
        time.sleep(0.5)
        pairs.clear()
        abort_world()
        return {"left": True}
    src, group = {0: (1, (0, 1)), 1: (2, (1, 2)), 3: (1, (1, 3))}[rank]
    t0 = time.monotonic()
    try:
        dist.recv(torch.ones(1), src=src, group=pairs[group])
        failed = False
    except Exception:  # noqa: BLE001 - the closed connection
        failed = True
    detect_s = time.monotonic() - t0
    pairs.clear()
    new_rank = {0: 0, 1: 1, 3: 2}[rank]
    remake_world(connect_store(TIMEOUT_S, addr, port), 1, new_rank, 3, TIMEOUT_S, release=[old])
    t = torch.tensor([float(new_rank)])
    dist.all_reduce(t)
    return {"failed": failed, "detect_s": detect_s, "sum": t.item()}


def test_a_failure_cascades_through_aborts_instead_of_hanging(job_store):
    results = run_ranks(_cascade, 4, *job_store, timeout=TIMEOUT_S * 2)
    assert results[2] == {"left": True}
    for r in (0, 1, 3):
        assert results[r]["failed"], results[r]
        assert results[r]["detect_s"] < TIMEOUT_S, results[r]  # not the collective timeout
        assert results[r]["sum"] == 3.0
