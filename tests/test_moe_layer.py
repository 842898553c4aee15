"""MoE layer parity: expert parallelism (EP), with TP/SP and DP, against one process (fp32).

Every parallel run trains a standalone MoELayer with hand-written SGD (``p -= lr * grad``) on the
same global batch as a single-process run of the same layer and seed: each DP rank's share of
the batch is one microbatch; the single process runs all microbatches in order. The loss is
``sum(y * probe) / (tokens of the global batch)``, so a wrong grad scale (x2 from a double
reduction) shows as a ratio of 2. Tolerances: grads and params 1e-5 (fp32 reassociation), router
replicas across TP bitwise.
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.models.moe.layer import MoELayer, aux_losses, set_aux_loss_scale
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import allreduce_sequence_parallel_grads
from paratron.parallel.params import load_full_
from paratron.local_ranks import run_ranks

from helpers import config_with

SEED = 1234
S, B, H = 8, 2, 16  # sequence, per-microbatch batch, hidden
TOL = dict(rtol=1e-5, atol=1e-6)


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                seq_length=S, num_experts=4, moe_top_k=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    base.update(kw)
    return ModelConfig(**base)


def _data(steps: int, num_mb: int, skew=None):
    g = torch.Generator().manual_seed(7)
    X = torch.randn(steps, S, num_mb * B, H, generator=g)
    P = torch.randn(steps, S, num_mb * B, H, generator=g)
    if skew is not None:
        X[..., 0] = skew  # [steps, S, num_mb*B] values of feature 0 (forced routing)
    return X, P


def _force_router(layer: MoELayer) -> None:
    """Router logits dominated by feature 0: x0 > 0 picks experts 0, 1; x0 < 0 picks 3, 2."""
    w = torch.zeros(4, H)
    w[:, 0] = torch.tensor([3.0, 2.0, -2.0, -3.0])
    load_full_(layer.router.weight, w)


def _train(ctx, cfg, steps, *, sp, mbs, num_mb, lr=0.1, data=None, force=False):
    """Train ``steps`` SGD steps on microbatches ``mbs`` of ``num_mb``; return per-step grads,
    final params (by logical name), input grads and the logged aux losses."""
    layer = MoELayer(cfg, ctx, layer_number=0, seed=SEED, sequence_parallel=sp)
    if force:
        _force_router(layer)
    set_aux_loss_scale(layer, 1.0 / num_mb)
    params = list(layer.parameters())
    X, P = data
    tp, sp_on = ctx.tp, sp and ctx.tp.size > 1
    n_total = S * B * num_mb
    out = {"grads": [], "xgrad": [], "aux": [], "params": {}}
    for step in range(steps):
        for p in params:
            p.grad = None
        for m in mbs:
            x, probe = X[step, :, m * B:(m + 1) * B], P[step, :, m * B:(m + 1) * B]
            if sp_on:
                n = S // tp.size
                x, probe = x[tp.rank * n:(tp.rank + 1) * n], probe[tp.rank * n:(tp.rank + 1) * n]
            x = x.clone().requires_grad_()
            y = layer(x)
            assert y.shape == x.shape
            ((y * probe).sum() / n_total).backward()
            out["xgrad"].append(x.grad.clone())
            out["aux"].append((float(layer.last_aux_loss), float(layer.last_z_loss)))
        allreduce_sequence_parallel_grads(params, ctx)
        for p in params:
            assert p.grad is not None, f"{p.meta.logical_name} has no grad"
            (ctx.expert_dp if p.meta.is_expert else ctx.dp).all_reduce(p.grad)
        out["grads"].append({p.meta.logical_name: p.grad.clone() for p in params})
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
    out["params"] = {p.meta.logical_name: p.detach().clone() for p in params}
    out["slices"] = {p.meta.logical_name: p.meta.shard.slices() for p in params}  # TP-split shared expert
    out["router_sp"] = layer.router.weight.meta.sequence_parallel
    return out


def _rank_fn(tp, ep, sp, cfg_kw, steps, force_skew, etp=1):
    ctx = ParallelContext.build(tp=tp, ep=ep, expert_tp=etp)
    cfg = _cfg(**cfg_kw)
    num_mb = ctx.dp.size
    data = _data(steps, num_mb, force_skew)
    res = _train(ctx, cfg, steps, sp=sp, mbs=[ctx.dp.rank], num_mb=num_mb, data=data, force=force_skew is not None)
    res.update(tp_rank=ctx.tp.rank, dp_rank=ctx.dp.rank, tp_size=ctx.tp.size)
    return res


def _reference(cfg_kw, steps, num_mb, force_skew=None):
    cfg = _cfg(**cfg_kw)
    return _train(ParallelContext.single(), cfg, steps, sp=False, mbs=list(range(num_mb)), num_mb=num_mb,
                  data=_data(steps, num_mb, force_skew), force=force_skew is not None)


def _check_parity(results, ref, sp):
    for res in results:
        for step, grads in enumerate(res["grads"]):
            for name, g in grads.items():
                want = ref["grads"][step][name][res["slices"][name]]
                torch.testing.assert_close(g, want, **TOL, msg=lambda m: f"step {step} grad {name}: {m}")
                if want.norm() > 0:  # the scale (1.0, not 2.0) stated explicitly
                    assert abs(float(g.norm() / want.norm()) - 1.0) < 1e-4, name
        for name, p in res["params"].items():
            want = ref["params"][name][res["slices"][name]]
            torch.testing.assert_close(p, want, **TOL, msg=lambda m: f"param {name}: {m}")
        # Input grads: this rank's microbatch (and sequence chunk under SP).
        mb, tp, r = res["dp_rank"], res["tp_size"], res["tp_rank"]
        n_mb = len(ref["xgrad"]) // len(res["grads"])
        for step in range(len(res["grads"])):
            want = ref["xgrad"][step * n_mb + mb]
            if sp and tp > 1:
                n = S // tp
                want = want[r * n:(r + 1) * n]
            torch.testing.assert_close(res["xgrad"][step], want, **TOL)
            # The logged aux loss is the whole microbatch's, whatever the layout.
            assert res["aux"][step] == pytest.approx(ref["aux"][step * n_mb + mb], rel=1e-5)


@pytest.mark.parametrize("ep,dispatcher", [(1, "alltoall"), (2, "alltoall"), (4, "alltoall"), (2, "allgather")])
def test_ep_parity(ep, dispatcher):
    """EP=1 (DP=2), 2 and 4 against one process: grads and params after 2 steps match to 1e-5."""
    world = max(ep, 2)
    kw = dict(moe_token_dispatcher=dispatcher)
    results = run_ranks(_rank_fn, world, 1, ep, False, kw, 2, None, timeout=180)
    _check_parity(results, _reference(kw, 2, world), sp=False)


@pytest.mark.parametrize("sp", [True, False])
def test_tp_ep_parity_and_router_replicas(sp):
    """TP=2 x EP=2 (DP=2, world 4), SP on and off: parity to 1e-5 for 3 steps, and the router weight
    bitwise equal on both TP ranks after 3 steps. The shared expert has Qwen2-MoE's per-token
    sigmoid gate (replicated weight, summed over TP under SP) and top-k probs are not renormalised."""
    kw = dict(moe_shared_expert_ffn_hidden_size=16, moe_shared_expert_gate=True, moe_router_norm_topk_prob=False)
    results = run_ranks(_rank_fn, 4, 2, 2, sp, kw, 3, None, timeout=180)
    _check_parity(results, _reference(kw, 3, 2), sp=sp)
    for a in results:
        assert a["router_sp"] == sp
        for b in results:
            if a["dp_rank"] == b["dp_rank"]:
                name = "layers.0.mlp.router.weight"
                assert torch.equal(a["params"][name], b["params"][name])


def test_tp_without_ep_parity():
    """TP=2, EP=1: the expert-DP group is the TP pair; each token must pass its experts once."""
    results = run_ranks(_rank_fn, 2, 2, 1, False, {}, 2, None, timeout=180)
    _check_parity(results, _reference({}, 2, 1), sp=False)


@pytest.mark.parametrize("world,tp,ep,sp,kw", [
    (2, 1, 1, False, dict()),
    (2, 1, 1, False, dict(activation="swiglu", add_bias_linear=False)),
    (4, 2, 2, True, dict()),
    (2, 1, 1, False, dict(moe_expert_gemm="grouped_mm")),  # bias added once over expert-TP (RowBias)
    (2, 1, 1, False, dict(moe_expert_gemm="bmm", activation="swiglu")),
])
def test_expert_tp_parity(world, tp, ep, sp, kw):
    """Expert-TP=2 (experts split over the expert-TP group, biases included): grads and params of
    every expert slice match one process to 1e-5 after 2 steps."""
    results = run_ranks(_rank_fn, world, tp, ep, sp, kw, 2, None, 2, timeout=180)
    _check_parity(results, _reference(kw, 2, world // tp), sp=sp)
    assert any(r["slices"]["layers.0.mlp.experts.0.fc2.weight"][1] != slice(0, 32) for r in results)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_dropping_parity(policy):
    """Capacity factor 0.5 (tokens are dropped): the same pairs are dropped under EP=2 and TP=2+SP
    as on one process, and with padding to capacity too, for both drop policies."""
    kw = dict(moe_capacity_factor=0.5, moe_pad_to_capacity=True, moe_token_drop_policy=policy)
    ref = _reference(kw, 2, 2)
    results = run_ranks(_rank_fn, 2, 1, 2, False, kw, 2, None, timeout=180)
    _check_parity(results, ref, sp=False)
    ref1 = _reference(kw, 2, 1)
    results = run_ranks(_rank_fn, 2, 2, 2, True, kw, 2, None, timeout=180)
    _check_parity(results, ref1, sp=True)


@pytest.mark.parametrize("world,etp", [(2, 1), (4, 2)])
def test_forced_routing_idle_rank(world, etp):
    """EP=2 (and EP=2 x expert-TP=2): in step 1 every token goes to experts 0 and 1 (EP rank 1
    idle), in step 2 half the microbatches go to experts 2 and 3. No error; experts 2, 3 get exactly
    zero grads in step 1; params equal one process after both steps; the router grad is nonzero
    with both loss coefficients at 0."""
    g = torch.Generator().manual_seed(3)
    skew = 2.0 + torch.rand(2, S, world * B, generator=g)
    skew[1, :, world * B // 2:] *= -1  # step 2: the later microbatches go to experts 2, 3
    kw = dict(moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0)
    results = run_ranks(_rank_fn, world, 1, 2, False, kw, 2, skew, etp, timeout=180)
    ref = _reference(kw, 2, world, skew)
    _check_parity(results, ref, sp=False)
    idle_rank = results[-1]  # holds experts 2 and 3
    step1 = idle_rank["grads"][0]
    idle = [n for n in step1 if ".experts.2." in n or ".experts.3." in n]
    assert len(idle) == 8
    for n in idle:
        assert torch.count_nonzero(step1[n]) == 0, n
        assert torch.count_nonzero(idle_rank["grads"][1][n]) > 0, n  # busy in step 2
    assert results[0]["grads"][0]["layers.0.mlp.router.weight"].norm() > 0


def _ledger_fn(dispatcher):
    ctx = ParallelContext.build(ep=2)
    cfg = _cfg(moe_token_dispatcher=dispatcher)
    layer = MoELayer(cfg, ctx, layer_number=0, seed=SEED, sequence_parallel=False)
    X, _ = _data(1, 2)
    x = X[0, :, ctx.dp.rank * B:(ctx.dp.rank + 1) * B].clone().requires_grad_()
    indices = layer.router(x.reshape(-1, H)).indices
    with ctx.ledger.recording():
        y = layer(x)
        fwd = ctx.ledger.total("all_to_all", "ep").bytes
        fwd_ag = ctx.ledger.total("all_gather", "ep").bytes
        fwd_rs = ctx.ledger.total("reduce_scatter", "ep").bytes
        y.sum().backward()
        both = ctx.ledger.total("all_to_all", "ep").bytes
    return dict(indices=indices, fwd=fwd, both=both, ag=fwd_ag, rs=fwd_rs)


def test_ledger_all_to_all_bytes():
    """The ledger's all-to-all bytes per MoE layer equal the analytic off-rank volume: forward
    ``h*4`` per row sent off-rank (dispatch) and per row returned (combine), plus ``E*8`` of counts;
    backward the same rows again."""
    res = run_ranks(_ledger_fn, 2, "alltoall", timeout=180)
    dest = [r["indices"] // 2 for r in res]  # 2 local experts per rank
    for r in range(2):
        sent = int((dest[r] != r).sum())
        received = int((dest[1 - r] == r).sum())
        rows = (sent + received) * H * 4
        assert res[r]["fwd"] == rows + 4 * 8
        assert res[r]["both"] == 2 * rows + 4 * 8
    # All-gather dispatch moves every token: the all-gather counts this rank's tokens and ids,
    # the reduce-scatter the whole EP group's slots.
    res = run_ranks(_ledger_fn, 2, "allgather", timeout=180)
    T, k = S * B, 2
    for r in res:
        assert r["ag"] == T * H * 4 + T * k * 8
        assert r["rs"] == 2 * T * k * H * 4


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------
def _layer(**kw) -> MoELayer:
    return MoELayer(_cfg(**kw), ParallelContext.single(), layer_number=0, seed=SEED, sequence_parallel=False)


def test_aux_loss_larger_when_unbalanced():
    """All tokens to two experts scores about E/2 = 2; random (roughly balanced) routing about 1."""
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0))
    balanced = _layer()
    balanced(x)
    skewed = _layer()
    _force_router(skewed)
    x2 = x.clone()
    x2[..., 0] = 3.0
    skewed(x2)
    assert aux_losses(balanced) == {"moe_aux_loss": float(balanced.last_aux_loss),
                                    "moe_z_loss": float(balanced.last_z_loss)}
    assert float(balanced.last_aux_loss) < 1.3
    assert float(skewed.last_aux_loss) > 1.8
    assert float(skewed.last_aux_loss) > 1.5 * float(balanced.last_aux_loss)


def test_capacity_padding_without_overflow_equals_dropless():
    """With a capacity no expert overflows, padding every expert to its capacity changes nothing:
    output, aux loss and grads equal the dropless layer to 1e-6."""
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    outs = []
    for kw in (dict(), dict(moe_capacity_factor=4.0, moe_pad_to_capacity=True)):
        layer = _layer(**kw)
        y = layer(x)
        y.square().sum().backward()
        outs.append((y.detach(), float(layer.last_aux_loss), {p.meta.logical_name: p.grad for p in layer.parameters()}))
    (y0, a0, g0), (y1, a1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    assert a1 == pytest.approx(a0, abs=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-6, atol=1e-6)


def test_capacity_drops_tokens():
    """A small capacity factor really drops: the output differs from the dropless one."""
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    assert not torch.allclose(_layer(moe_capacity_factor=0.25)(x), _layer()(x))


def test_ties_go_to_lowest_expert():
    from paratron.models.moe.router import top_k

    scores = torch.tensor([[0.1, 0.3, 0.3, 0.3], [0.5, 0.5, 0.0, 0.5]])
    _, idx = top_k(scores, 2)
    assert idx.tolist() == [[1, 2], [0, 1]]


def test_sigmoid_router_and_swiglu_run():
    layer = _layer(moe_router_score="sigmoid", activation="swiglu", add_bias_linear=False, moe_top_k=1)
    x = torch.randn(S, B, H)
    layer(x).sum().backward()
    assert layer.router.weight.grad.norm() > 0  # top-1 keeps the raw score, so the router learns
    names = {p.meta.logical_name for p in layer.parameters()}
    assert "layers.0.mlp.experts.3.gate.weight" in names and "layers.0.mlp.experts.3.up.weight" in names


def test_bad_config_errors():
    from paratron.models.moe.dispatcher import get_dispatcher, register_dispatcher

    with pytest.raises(ValueError, match="moe_token_dispatcher='nope'"):
        _layer(moe_token_dispatcher="nope")
    with pytest.raises(ValueError, match="moe_pad_to_capacity"):
        _layer(moe_pad_to_capacity=True)
    with pytest.raises(ValueError, match="num_experts=0"):
        _layer(num_experts=0)
    with pytest.raises(ValueError, match="already registered"):
        register_dispatcher("alltoall", object)
    assert get_dispatcher("allgather").__name__ == "AllGatherDispatcher"


def test_aux_loss_gradient_reaches_router_only():
    """The aux-loss attachment leaves the output unchanged and adds coeff * scale * d(aux) to the
    router grad (checked against autograd of the explicit loss)."""
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    with_aux, without = _layer(moe_aux_loss_coeff=0.5, moe_z_loss_coeff=0.0), _layer(moe_aux_loss_coeff=0.0,
                                                                                     moe_z_loss_coeff=0.0)
    set_aux_loss_scale(with_aux, 0.25)
    y1, y0 = with_aux(x), without(x)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)
    y1.sum().backward()
    routing = without.router(x.reshape(-1, H))
    (y0.sum() + 0.25 * 0.5 * routing.aux_loss).backward()
    torch.testing.assert_close(with_aux.router.weight.grad, without.router.weight.grad, rtol=1e-6, atol=1e-7)


def test_drop_priority_is_position_then_earlier_ranks():
    """Capacity 2: per expert the first two (token, slot) pairs in microbatch order are kept;
    pairs already held by earlier ranks of the stats group count first."""
    from paratron.models.moe.router import drop_over_capacity, expert_capacity

    indices = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 1]])
    kept = drop_over_capacity(indices, 2, torch.zeros(4))
    assert kept.tolist() == [[0, 1], [0, 2], [1, -1], [3, -1]]
    # An earlier rank already routed one pair to expert 0 and two to expert 3.
    kept = drop_over_capacity(indices, 2, torch.tensor([1.0, 0.0, 0.0, 2.0]))
    assert kept.tolist() == [[0, 1], [-1, 2], [1, -1], [-1, -1]]
    assert expert_capacity(16, 4, 2, 1.0) == 8 and expert_capacity(15, 4, 2, 1.0) == 8
    with pytest.raises(ValueError, match="moe_capacity_factor"):
        expert_capacity(16, 4, 2, 0.0)


def test_flops_count_active_experts_only():
    """Model FLOPs of an MoE layer grow with top-k, not with the number of experts (only the router
    term 2hE does): 3 x forward per token, one SwiGLU expert is 3 matmuls of 2hf."""
    from paratron.models.flops import flops_per_token

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8,
                activation="swiglu", moe_ffn_hidden_size=24)
    f = lambda **kw: flops_per_token(ModelConfig(**{**base, **kw}))  # noqa: E731
    one_expert = 3 * (3 * 2 * 16 * 24)
    assert f(num_experts=8, moe_top_k=2) - f(num_experts=8, moe_top_k=1) == one_expert
    assert f(num_experts=8, moe_top_k=2) - f(num_experts=4, moe_top_k=2) == 3 * 2 * 16 * 4
    assert f(num_experts=4, moe_top_k=2, moe_shared_expert_ffn_hidden_size=24) - \
        f(num_experts=4, moe_top_k=2) == one_expert


def test_config_rules_checked_before_any_group():
    """MoE config rules fail in ``validate`` (before process groups), naming field and rule."""
    from paratron.config import ConfigError
    from paratron.rules import validate

    def cfg(**kw):
        return config_with(model__num_experts=4, **kw)

    with pytest.raises(ConfigError, match="moe_pad_to_capacity"):
        validate(cfg(model__moe_pad_to_capacity=True))
    with pytest.raises(ConfigError, match=r"model.moe_ffn_hidden_size=30 .* parallel.expert_tensor=4"):
        validate(cfg(model__moe_ffn_hidden_size=30, parallel__expert_tensor=4), 4)
    with pytest.raises(ConfigError, match=r"moe_shared_expert_ffn_hidden_size=5 .* parallel.tensor=2"):
        validate(cfg(model__moe_shared_expert_ffn_hidden_size=5, parallel__tensor=2), 2)
    validate(cfg(model__moe_ffn_hidden_size=32, parallel__expert_tensor=4), 4)


def test_registered_dispatcher_is_selected_by_name():
    """A dispatcher registered under a new name is what model.moe_token_dispatcher selects, and a
    subclass that only observes gives the built-in result."""
    from paratron.models.moe.dispatcher import AllToAllDispatcher, register_dispatcher

    seen = []

    class Observing(AllToAllDispatcher):
        def dispatch(self, tokens, indices):
            seen.append(tuple(indices.shape))
            return super().dispatch(tokens, indices)

    register_dispatcher("test-observing", Observing)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(5))
    y = _layer(moe_token_dispatcher="test-observing")(x)
    assert seen == [(S * B, 2)]
    torch.testing.assert_close(y, _layer()(x), rtol=0, atol=0)


@pytest.mark.parametrize("world,tp,sp", [(2, 1, False), (4, 2, True)])
def test_chunked_dispatcher_matches_plain(world, tp, sp):
    """The chunked, overlapped all-to-all dispatcher against the plain one at EP=2 and EP=2 x TP=2
    (SP): every grad, param, input grad and aux value over 3 steps to 1e-6."""
    plain = run_ranks(_rank_fn, world, tp, 2, sp, dict(moe_token_dispatcher="alltoall"), 3, None, timeout=180)
    chunked = run_ranks(_rank_fn, world, tp, 2, sp, dict(moe_token_dispatcher="alltoall_chunked"), 3, None,
                        timeout=180)
    tol = dict(rtol=1e-6, atol=1e-6)
    for a, b in zip(plain, chunked):
        for ga, gb in zip(a["grads"], b["grads"]):
            for name in ga:
                torch.testing.assert_close(gb[name], ga[name], **tol, msg=lambda m: f"grad {name}: {m}")
        for name in a["params"]:
            torch.testing.assert_close(b["params"][name], a["params"][name], **tol)
        for xa, xb in zip(a["xgrad"], b["xgrad"]):
            torch.testing.assert_close(xb, xa, **tol)
        assert [v for pair in a["aux"] for v in pair] == pytest.approx([v for pair in b["aux"] for v in pair], rel=1e-6)
