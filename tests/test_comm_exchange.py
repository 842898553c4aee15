"""On the CPU, ``Group``'s all-gathers and SUM reduce-scatters run as all-to-alls
(:mod:`paratron.parallel.comm`): their results must equal gloo's native collectives, sync and
async, flat and along a dim, with the output inside the input, on the edge ranks (which keep
their own slice) and the middle ones of 4, and the ledger must still see the logical op."""

import torch
import torch.distributed as dist

from paratron.local_ranks import run_ranks
from paratron.parallel.comm import Group


def _group() -> Group:
    n = dist.get_world_size()
    return Group(name="dp", ranks=list(range(n)), rank=dist.get_rank(), pg=dist.group.WORLD)


def _data(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(17 + rank))


def _compare(_):
    g, r, n = _group(), dist.get_rank(), dist.get_world_size()
    t = _data(r, n * 1000)
    ref = torch.empty(1000)
    dist.reduce_scatter_tensor(ref, t.clone())
    out = {"rs_ref": ref}
    got = torch.full((1000,), float("nan"))
    g.reduce_scatter_into(got, t)
    out["rs"] = got
    got_async = torch.full((1000,), float("nan"))
    h = g.reduce_scatter_into(got_async, t, async_op=True)
    h.wait()
    h.wait()  # a second wait sums nothing again
    out["rs_async"], out["rs_async_ref"] = got_async, ref
    inplace = t.clone()  # the output is this rank's slice of the input itself
    g.reduce_scatter_into(inplace[r * 1000:(r + 1) * 1000], inplace)
    out["rs_inplace"], out["rs_inplace_ref"] = inplace[r * 1000:(r + 1) * 1000], ref
    x = _data(r, 3 * 5 * 4).view(3, 5, 4)
    ag_ref = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(ag_ref, x)
    out["ag_dim1_ref"], out["ag_dim1"] = torch.cat(ag_ref, dim=1), g.all_gather(x, dim=1)
    flat = torch.empty(n * x.numel())
    g.all_gather_into(flat, x.reshape(-1), async_op=True).wait()
    out["ag_flat_ref"], out["ag_flat"] = torch.cat([a.reshape(-1) for a in ag_ref]), flat
    y = _data(r, 3 * 4 * n).view(3, 4 * n)
    rs_dim_ref = torch.empty(3 * 4)
    dist.reduce_scatter_tensor(rs_dim_ref, y.t().contiguous().reshape(-1))
    out["rs_dim1_ref"], out["rs_dim1"] = rs_dim_ref.view(4, 3).t(), g.reduce_scatter(y, dim=1)
    mx = torch.empty(1000)
    g.reduce_scatter_into(mx, t, op=dist.ReduceOp.MAX)  # not a SUM: gloo's own collective
    out["max"], out["max_ref"] = mx, torch.stack([_data(k, n * 1000) for k in range(n)]).amax(0).view(n, -1)[r]
    with g.ledger.recording():
        g.reduce_scatter_into(got, t)
        g.all_gather_into(flat, x.reshape(-1))
    out["ledger"] = {op: (e.calls, e.bytes) for (op, _), e in g.ledger.entries.items()}
    return out


def _check(world: int) -> None:
    for rank, out in enumerate(run_ranks(_compare, world, None, timeout=120)):
        exact = world == 2  # a + b == b + a; four addends may be summed in another order
        for name in ("rs", "rs_async", "rs_inplace", "rs_dim1"):
            if exact:
                assert torch.equal(out[name], out[name + "_ref"]), (rank, name)
            else:
                torch.testing.assert_close(out[name], out[name + "_ref"], rtol=1e-6, atol=1e-6)
        for name in ("ag_dim1", "ag_flat", "max"):
            assert torch.equal(out[name], out[name + "_ref"]), (rank, name)
        assert out["ledger"] == {"reduce_scatter": (1, 4 * world * 1000), "all_gather": (1, 4 * 60)}, out["ledger"]


def test_exchanged_collectives_equal_gloos_on_2_ranks():
    _check(2)


def test_exchanged_collectives_equal_gloos_on_4_ranks():
    _check(4)
