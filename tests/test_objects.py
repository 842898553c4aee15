"""The host object collectives (:mod:`paratron.parallel.objects`) return what torch's
``all_gather_object`` / ``gather_object`` return: objects of different sizes on each rank (empty
strings, None, a large list), in group-rank order, on the whole world and on a subgroup whose
destination is not global rank 0; and :class:`Group` uses them on the CPU."""

import torch.distributed as dist

from paratron.local_ranks import run_ranks
from paratron.parallel.comm import Group
from paratron.parallel.objects import all_gather_objects, gather_objects


def _obj(rank: int):
    # Sizes differ by rank, so every rank's frame is padded to another rank's length.
    return [None, "", {"rank": rank, "data": list(range(rank * 500))}, b"\x00" * (3 - rank % 3)]


def _compare(_):
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    ref = [None] * n
    dist.all_gather_object(ref, _obj(r))
    out["all"], out["all_ref"] = all_gather_objects(_obj(r), dist.group.WORLD), ref
    dst = n - 1
    ref_g = [None] * n if r == dst else None
    dist.gather_object(_obj(r), ref_g, dst=dst)
    out["gather"], out["gather_ref"] = gather_objects(_obj(r), dist.group.WORLD, group_dst=dst), ref_g
    # A subgroup of the odd ranks: its group rank 0 is global rank 1.
    odd = dist.new_group([k for k in range(n) if k % 2 == 1])
    if r % 2 == 1:
        out["sub"] = all_gather_objects(_obj(r), odd)
        out["sub_gather"] = gather_objects(_obj(r), odd, group_dst=0)
    group = Group(name="world", ranks=list(range(n)), rank=r, pg=dist.group.WORLD)
    out["group"] = group.all_gather_object(_obj(r))
    return out


def _check(world: int) -> None:
    res = run_ranks(_compare, world, None, timeout=120)
    every = [_obj(k) for k in range(world)]
    odd = [_obj(k) for k in range(world) if k % 2 == 1]
    for r, out in enumerate(res):
        assert out["all"] == out["all_ref"] == every
        assert out["group"] == every
        assert out["gather"] == out["gather_ref"]
        assert out["gather"] == (every if r == world - 1 else None)
        if r % 2 == 1:
            assert out["sub"] == odd
            assert out["sub_gather"] == (odd if r == 1 else None)


def test_object_collectives_two_ranks():
    _check(2)


def test_object_collectives_four_ranks():
    _check(4)
