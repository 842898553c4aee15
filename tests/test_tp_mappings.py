"""The f/g collectives, the sequence-divisibility error, layout-independent init and the RNG
tracker, on real gloo ranks."""

import pytest
import torch
import torch.nn.functional as F

from paratron.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from paratron.layers.init import full_init, normal_, scaled_normal_, seed_for
from paratron.parallel import mappings as M
from paratron.parallel.context import ParallelContext
from paratron.parallel.random import RNGStatesTracker
from paratron.local_ranks import run_ranks


def _t(name, shape):
    return full_init(shape, 3, name, 1.0)


def _mapping_rank(tp):
    """Returns (got, want) pairs for every mapping's forward output and input grad."""
    ctx = ParallelContext.build(tp=tp)
    g, r = ctx.tp, ctx.tp.rank
    each = lambda name, shape: [_t(f"{name}.{i}", shape) for i in range(tp)]  # noqa: E731
    out = {}

    def run(key, fn, x, grad):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(grad)
        out[key] = (y.detach(), x.grad)

    x = _t("x", (4, 2, 8))
    gs = each("g", (4, 2, 8))
    run("copy", lambda v: M.copy_to_tp_region(v, g), x, gs[r])
    out["copy_want"] = (x, sum(gs))

    xs = each("x", (4, 2, 8))
    run("reduce", lambda v: M.reduce_from_tp_region(v, g), xs[r], gs[0])
    out["reduce_want"] = (sum(xs), gs[0])

    w = 8 // tp
    gs_small = each("gs", (4, 2, w))
    run("scatter_last", lambda v: M.scatter_to_tp_region(v, g), x, gs_small[r])
    out["scatter_last_want"] = (x[..., r * w:(r + 1) * w], torch.cat(gs_small, dim=-1))

    xs_small = each("xs", (4, 2, w))
    run("gather_last", lambda v: M.gather_from_tp_region(v, g), xs_small[r], gs[0])
    out["gather_last_want"] = (torch.cat(xs_small, dim=-1), gs[0][..., r * w:(r + 1) * w])

    s = 4 // tp
    xs_seq = each("xq", (s, 2, 8))
    run("gather_seq", lambda v: M.gather_from_sequence_parallel_region(v, g), xs_seq[r], gs[r])
    out["gather_seq_want"] = (torch.cat(xs_seq), sum(gs)[r * s:(r + 1) * s])
    run("gather_seq_full", lambda v: M.gather_from_sequence_parallel_region(v, g, grad_is_partial=False),
        xs_seq[r], gs[0])
    out["gather_seq_full_want"] = (torch.cat(xs_seq), gs[0][r * s:(r + 1) * s])

    gs_seq = each("gq", (s, 2, 8))
    run("reduce_scatter_seq", lambda v: M.reduce_scatter_to_sequence_parallel_region(v, g), xs[r], gs_seq[r])
    out["reduce_scatter_seq_want"] = (sum(xs)[r * s:(r + 1) * s], torch.cat(gs_seq))

    run("scatter_seq", lambda v: M.scatter_to_sequence_parallel_region(v, g), x, gs_seq[r])
    out["scatter_seq_want"] = (x[r * s:(r + 1) * s], torch.cat(gs_seq))
    return out


MAPPINGS = ["copy", "reduce", "scatter_last", "gather_last", "gather_seq", "gather_seq_full",
            "reduce_scatter_seq", "scatter_seq"]


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_forward_and_backward(tp):
    for rank, res in enumerate(run_ranks(_mapping_rank, tp, tp, timeout=180)):
        for key in MAPPINGS:
            (y, dx), (want_y, want_dx) = res[key], res[key + "_want"]
            torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6, msg=f"{key} fwd rank {rank}")
            torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-6, msg=f"{key} bwd rank {rank}")


def test_mappings_are_identity_on_one_rank():
    g = ParallelContext.single().tp
    x = torch.randn(4, 2, 3)
    for fn in (M.copy_to_tp_region, M.reduce_from_tp_region, M.scatter_to_tp_region, M.gather_from_tp_region,
               M.gather_from_sequence_parallel_region, M.reduce_scatter_to_sequence_parallel_region,
               M.scatter_to_sequence_parallel_region):
        assert fn(x, g) is x


# ---- the dim-parameterised pairs, the uneven all-to-all and the Ulysses exchange -----------
def _grad_of(fn, x, grad):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _dim_pairs_rank(c):
    ctx = ParallelContext.build(tp=c)
    g, r = ctx.tp, ctx.tp.rank
    each = lambda name, shape: [_t(f"{name}.{i}", shape) for i in range(c)]  # noqa: E731
    out = {}
    xs, gs = each("x", (3, 2 * c, 5)), each("g", (3, 2 * c, 5))
    small = each("s", (3, 2, 5))
    out["gather_dim1"] = (_grad_of(lambda v: M.gather_along_dim(v, g, 1), small[r], gs[r]),
                          (torch.cat(small, dim=1), sum(gs)[:, 2 * r:2 * r + 2]))
    out["reduce_scatter_dim1"] = (_grad_of(lambda v: M.reduce_scatter_along_dim(v, g, 1), xs[r], small[r]),
                                  (sum(xs)[:, 2 * r:2 * r + 2], torch.cat(small, dim=1)))
    out["split_dim1"] = (_grad_of(lambda v: M.split_along_dim(v, g, 1), xs[0], small[r]),
                         (xs[0][:, 2 * r:2 * r + 2], torch.cat(small, dim=1)))
    # Uneven all-to-all: rank i sends f(i, j) = i + 2j + 1 rows to rank j (asymmetric splits).
    f = lambda i, j: i + 2 * j + 1  # noqa: E731
    sends = [_t(f"a.{i}", (sum(f(i, j) for j in range(c)), 4)) for i in range(c)]
    backs = [_t(f"ab.{j}", (sum(f(q, j) for q in range(c)), 4)) for j in range(c)]
    sent_at = lambda i, j: sum(f(i, q) for q in range(j))  # noqa: E731   where i's rows for j start
    got_at = lambda j, i: sum(f(q, j) for q in range(i))  # noqa: E731    where j's rows from i start
    want = torch.cat([sends[j][sent_at(j, r):sent_at(j, r) + f(j, r)] for j in range(c)])
    want_grad = torch.cat([backs[j][got_at(j, r):got_at(j, r) + f(r, j)] for j in range(c)])
    out["all_to_all"] = (_grad_of(lambda v: M.all_to_all(v, g, [f(j, r) for j in range(c)],
                                                         [f(r, j) for j in range(c)]), sends[r], backs[r]),
                         (want, want_grad))
    # Ulysses: [s/C, b, n, d] sequence shards -> [s, b, n/C, d] head shards, and back.
    n = 2 * c
    q, gq = each("q", (3, 2, n, 4)), each("gq", (3 * c, 2, 2, 4))
    full, full_grad = torch.cat(q), torch.cat(gq, dim=2)
    out["seq_to_heads"] = (_grad_of(lambda v: M.all_to_all_seq_to_heads(v, g), q[r], gq[r]),
                           (full[:, :, 2 * r:2 * r + 2], full_grad[3 * r:3 * r + 3]))
    out["heads_to_seq"] = (_grad_of(lambda v: M.all_to_all_heads_to_seq(v, g), full[:, :, 2 * r:2 * r + 2],
                                    q[r]),
                           (q[r], torch.cat(q)[:, :, 2 * r:2 * r + 2]))
    return out


@pytest.mark.parametrize("c", [2, 3])
def test_dim_pairs_all_to_all_and_ulysses_forward_and_backward(c):
    for rank, res in enumerate(run_ranks(_dim_pairs_rank, c, c, timeout=180)):
        for key, ((y, dx), (want_y, want_dx)) in res.items():
            torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-6, msg=f"{key} fwd rank {rank}")
            torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-6, msg=f"{key} bwd rank {rank}")


# ---- sequence not divisible by TP: a clear error before any collective --------------------
def _indivisible_rank():
    ctx = ParallelContext.build(tp=2)
    errors = []
    emb = VocabParallelEmbedding(100, 8, ctx, logical_name="e", seed=1, sequence_parallel=True)
    row = RowParallelLinear(8, 8, ctx, logical_name="r", seed=1, sequence_parallel=True)
    calls = [
        lambda: M.reduce_scatter_to_sequence_parallel_region(torch.ones(7, 2, 8), ctx.tp),
        lambda: M.scatter_to_sequence_parallel_region(torch.ones(7, 2, 8), ctx.tp),
        lambda: emb(torch.zeros(2, 7, dtype=torch.long)),
        lambda: row(torch.ones(7, 2, 4)),
    ]
    with ctx.ledger.recording():
        for call in calls:
            try:
                call()
            except ValueError as e:
                errors.append(str(e))
        issued = ctx.ledger.total().calls
    t = torch.ones(1)
    ctx.tp.all_reduce(t)  # the ranks are still in step: nothing half-issued
    return errors, issued, t.item()


def test_sequence_parallel_indivisible_sequence_is_a_clear_error():
    for errors, issued, total in run_ranks(_indivisible_rank, 2, timeout=180):
        assert len(errors) == 4, errors
        for e in errors:
            assert "seq_length=7" in e and "parallel.tensor=2" in e, e
        assert issued == 0 and total == 2.0


# ---- layout-independent initialisation ----------------------------------------------------
def _build(ctx):
    return [
        ColumnParallelLinear(16, 32, ctx, logical_name="c", seed=5),
        RowParallelLinear(32, 16, ctx, logical_name="r", seed=5, init_method=scaled_normal_(0.02, 4)),
        VocabParallelEmbedding(1000, 16, ctx, logical_name="e", seed=5, make_vocab_size_divisible_by=64),
    ]


def _init_rank():
    ctx = ParallelContext.build(tp=4)
    params = {p.meta.logical_name: (p.detach().clone(), p.meta.shard) for m in _build(ctx) for p in m.parameters()}
    errors = []
    for bad in (lambda: ColumnParallelLinear(16, 30, ctx, logical_name="bad", seed=5),
                lambda: RowParallelLinear(30, 16, ctx, logical_name="bad", seed=5)):
        try:
            bad()
        except ValueError as e:
            errors.append(str(e))
    return params, errors, seed_for(5, "c.weight")


def test_tp4_starts_from_the_tp1_weights():
    single = {p.meta.logical_name: p.detach() for m in _build(ParallelContext.single()) for p in m.parameters()}
    results = run_ranks(_init_rank, 4, timeout=180)
    for params, errors, seed in results:
        assert seed == seed_for(5, "c.weight"), "the init seed must not depend on the process"
        assert "out_features=30 is not divisible by parallel.tensor=4" in errors[0]
        assert "in_features=30 is not divisible by parallel.tensor=4" in errors[1]
        for name, (local, spec) in params.items():
            full = single[name]
            assert torch.equal(spec.valid(local), full[spec.slices()]), name
    # The TP=1 weights are the seeded full draws, with the requested std.
    assert torch.equal(single["c.weight"], full_init((32, 16), 5, "c.weight", 0.02))
    assert torch.equal(single["r.weight"], full_init((16, 32), 5, "r.weight", 0.02 / 8 ** 0.5))
    assert torch.count_nonzero(single["c.bias"]) == 0


def test_init_depends_on_seed_and_name_only():
    a = normal_(0.5)((64, 64), seed=1, logical_name="w")
    assert torch.equal(a, normal_(0.5)((64, 64), seed=1, logical_name="w"))
    assert not torch.equal(a, normal_(0.5)((64, 64), seed=2, logical_name="w"))
    assert not torch.equal(a, normal_(0.5)((64, 64), seed=1, logical_name="v"))
    assert abs(a.std().item() - 0.5) < 0.02
    with pytest.raises(ValueError, match="model.num_layers"):
        scaled_normal_(0.02, 0)


# ---- RNG tracker --------------------------------------------------------------------------
def _rng_rank():
    ctx = ParallelContext.build(tp=2)
    tracker = RNGStatesTracker(11, ctx)
    tracker.seed_default_stream()
    before = torch.rand(6)
    with tracker.fork():
        inside = F.dropout(torch.ones(16), 0.5)
    after = torch.rand(6)

    saved = tracker.get_states()
    with tracker.fork():
        m1 = torch.rand(6)
    d1 = torch.rand(6)
    tracker.set_states(saved)
    with tracker.fork():
        m2 = torch.rand(6)
    d2 = torch.rand(6)
    try:
        tracker.set_states({"nope": saved["default"]})
        unknown = None
    except ValueError as e:
        unknown = str(e)
    return {"before": before, "inside": inside, "after": after, "replay": (m1, m2, d1, d2),
            "unknown": unknown, "tp_rank": ctx.tp.rank}


def test_rng_tracker_streams():
    r0, r1 = run_ranks(_rng_rank, 2, timeout=180)
    torch.manual_seed(11)
    plain = torch.rand(6), torch.rand(6)
    for r in (r0, r1):
        # The default stream is the same on every TP rank and is not advanced by forks.
        assert torch.equal(r["before"], plain[0]) and torch.equal(r["after"], plain[1])
        m1, m2, d1, d2 = r["replay"]
        assert torch.equal(m1, m2) and torch.equal(d1, d2), "restored states must replay"
        assert "nope" in r["unknown"]
        torch.manual_seed(11 + 2718 + r["tp_rank"])
        assert torch.equal(r["inside"], F.dropout(torch.ones(16), 0.5))
    assert not torch.equal(r0["inside"], r1["inside"]), "TP ranks must draw different dropout masks"


# ---- allreduce_sequence_parallel_grads -----------------------------------------------------
def _sp_grads_rank():
    from paratron.parallel.grads import allreduce_sequence_parallel_grads
    from paratron.parallel.params import mark

    ctx = ParallelContext.build(tp=2)
    r = float(ctx.tp.rank + 1)
    a = mark(torch.nn.Parameter(torch.zeros(3)), "a", sequence_parallel=True)
    a.meta.main_grad = torch.full((3,), r)  # DDP's fp32 main grad takes precedence over .grad
    a.grad = torch.full((3,), 100.0)
    b = mark(torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16)), "b", sequence_parallel=True)
    b.grad = torch.full((2, 2), r, dtype=torch.bfloat16)
    c = mark(torch.nn.Parameter(torch.zeros(2)), "c")  # not sequence parallel: left alone
    c.grad = torch.full((2,), r)
    with ctx.ledger.recording():
        allreduce_sequence_parallel_grads([a, b, c], ctx)
        calls = ctx.ledger.total("all_reduce", "tp").calls
    return a.meta.main_grad, a.grad, b.grad, c.grad, calls


def test_allreduce_sequence_parallel_grads():
    for rank, (am, ag, bg, cg, calls) in enumerate(run_ranks(_sp_grads_rank, 2, timeout=180)):
        assert torch.equal(am, torch.full((3,), 3.0)) and torch.equal(ag, torch.full((3,), 100.0))
        assert torch.equal(bg, torch.full((2, 2), 3.0, dtype=torch.bfloat16))
        assert torch.equal(cg, torch.full((2,), rank + 1.0))
        assert calls == 2, "one coalesced all-reduce per grad dtype"
