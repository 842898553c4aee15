"""The prefetch dispatcher (PopFetcher, USENIX ATC'25; docs/popfetcher.md) against the all-to-all
dispatcher (fp32).

* Parity: at EP=2 and EP=2 x TP=2 (SP on and off), a standalone MoE layer trained 3 SGD steps with the
  prefetch dispatcher under each policy (``pull`` forced, ``push`` forced, ``auto``) matches the
  all-to-all dispatcher's grads, params, input grads and aux losses to 1e-6; the per-forward
  stats show that ``pull`` pulled, ``push`` pushed and ``auto`` did both. Through the training
  stack (DDP with its ``grad_uses`` wait, the pipeline runtime), the GPT model with the prefetch
  dispatcher matches one process (1e-5, the tolerance of test_moe_gpt.py).
* A skewed router: the share of (token, slot) pairs computed on their own rank rises and the
  ledger's EP bytes per step fall against the all-to-all dispatcher (figures printed).
* Timeline: in a GPT chunk, each layer's weight fetch is outstanding over its whole attention
  compute interval and waited on before the experts run (structural, from the interval order).
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import ConfigError, ModelConfig
from paratron.rules import validate
from paratron.config.aliases import MEGATRON_ALIASES
from paratron.models.gpt import GPTChunk
from paratron.models.moe import prefetch
from paratron.models.moe.layer import MoELayer, moe_layers
from paratron.parallel.context import ParallelContext
from paratron.parallel.intervals import overlaps, recording, timed
from paratron.parallel.params import load_full_
from paratron.local_ranks import run_ranks

from helpers import config_with
from test_moe_gpt import _config as gpt_config, _reference as gpt_reference, _train as gpt_train
from test_moe_layer import S, B, _cfg, _data, _train
from test_moe_wgrad import STEPS as wgrad_steps, _assert_matches as wgrad_matches, _cfg as wgrad_cfg, \
    _reference as wgrad_reference, _run as wgrad_run

TOL = dict(rtol=1e-6, atol=1e-6)
POLICIES = ("pull", "push", "auto")


def _skew(steps: int, num_mb: int) -> torch.Tensor:
    """Feature 0 of every token (routes it, see test_moe_layer._force_router): 90% positive
    (experts 0, 1 on EP rank 0), 10% negative (experts 3, 2 on EP rank 1)."""
    g = torch.Generator().manual_seed(5)
    sign = torch.where(torch.rand(steps, S, num_mb * B, generator=g) < 0.9, 1.0, -1.0)
    return sign * (0.5 + torch.rand(steps, S, num_mb * B, generator=g))


def _train_seeing_stats(ctx, cfg, steps, **run) -> dict:
    """:func:`test_moe_layer._train`, plus each prefetch forward's ``last_stats`` (``"stats"``)."""
    observe, seen = prefetch.PrefetchState.observe, []

    def spy(self, indices, pulled, n):
        observe(self, indices, pulled, n)
        seen.append(dict(self.last_stats))
    prefetch.PrefetchState.observe = spy
    try:
        return {**_train(ctx, cfg, steps, **run), "stats": seen}
    finally:
        prefetch.PrefetchState.observe = observe


def _policies_against_alltoall(tp: int, sp: bool, steps: int):
    ctx = ParallelContext.build(tp=tp, ep=2)
    num_mb = ctx.dp.size
    data = _data(steps, num_mb, _skew(steps, num_mb))
    # Small experts (P = 49 params) so that auto's rule (pairs * h > P) pulls the hot ones.
    kw = dict(moe_ffn_hidden_size=1)
    run = dict(sp=sp, mbs=[ctx.dp.rank], num_mb=num_mb, data=data, force=True)
    out = {"alltoall": _train(ctx, _cfg(**kw, moe_token_dispatcher="alltoall"), steps, **run)}
    for policy in POLICIES:
        cfg = _cfg(**kw, moe_token_dispatcher="prefetch", moe_prefetch_policy=policy)
        out[policy] = _train_seeing_stats(ctx, cfg, steps, **run)
    return out


@pytest.mark.parametrize("world,tp,sp", [(2, 1, False), (4, 2, True), (4, 2, False)])
def test_prefetch_matches_alltoall_with_pull_and_push(world, tp, sp):
    """EP=2 (world 2) and EP=2 x TP=2 (world 4) with SP and without (each TP rank dispatches its
    1/tp of the tokens): 3 steps, every policy, to 1e-6."""
    results = run_ranks(_policies_against_alltoall, world, tp, sp, 3, timeout=240)
    for policy in POLICIES:
        pulled = sum(s["pulled"] for r in results for s in r[policy]["stats"])
        pushed = sum(s["pairs"] - s["own"] - s["pulled"] for r in results for s in r[policy]["stats"])
        assert (pulled > 0, pushed > 0) == {"pull": (True, False), "push": (False, True),
                                           "auto": (True, True)}[policy], (policy, pulled, pushed)
        for res in results:
            want, got = res["alltoall"], res[policy]
            for step, (ga, gb) in enumerate(zip(want["grads"], got["grads"])):
                for name in ga:
                    torch.testing.assert_close(gb[name], ga[name], **TOL,
                                               msg=lambda m: f"{policy} step {step} grad {name}: {m}")
            for name in want["params"]:
                torch.testing.assert_close(got["params"][name], want["params"][name], **TOL)
            for xa, xb in zip(want["xgrad"], got["xgrad"]):
                torch.testing.assert_close(xb, xa, **TOL)
            assert [v for p in got["aux"] for v in p] == pytest.approx([v for p in want["aux"] for v in p], rel=1e-6)


def _gpt_rank(kw: dict, world: int, policy: str):
    cfg = gpt_config(world=world, dispatcher="prefetch", **kw)
    cfg.model.moe_prefetch_policy = policy
    p = cfg.parallel
    ctx = ParallelContext.build(tp=p.tensor, ep=p.expert, pp=p.pipeline)
    return gpt_train(cfg, ctx)


@pytest.mark.parametrize("world,kw", [(2, dict(ep=2)), (4, dict(ep=2, pp=2))], ids=["ep2", "ep2-pp2"])
def test_prefetch_gpt_matches_one_process(world, kw):
    """The GPT model through the training stack (DDP waits for both grad events of every expert
    param; with PP=2 each stage's first MoE layer has no predecessor), pull forced: updates,
    params and losses match one process with the all-to-all dispatcher (1e-5)."""
    results = run_ranks(_gpt_rank, world, kw, world, "pull", timeout=240)
    ref = gpt_reference()
    for res in results:
        for n, (upd, slices) in res["update"].items():
            torch.testing.assert_close(upd, ref["update"][n][0][slices], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"grad {n}: {m}")
        for n, (p, slices) in res["params"].items():
            torch.testing.assert_close(p, ref["params"][n][0][slices], rtol=1e-5, atol=1e-5)
        for (loss, _), (rloss, _) in zip(res["history"], ref["history"]):
            assert loss == pytest.approx(rloss, rel=1e-5)


SKEW_S, SKEW_B, H = 64, 4, 16


def _skewed_bytes(dispatcher: str, steps: int = 3):
    """EP=2: an MoE layer whose router sends 90% of the tokens to experts 0, 1 (EP rank 0);
    the last step's EP bytes (forward + backward) and this rank's stay-local share."""
    ctx = ParallelContext.build(ep=2)
    cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                      seq_length=SKEW_S, num_experts=4, moe_top_k=2, moe_token_dispatcher=dispatcher)
    layer = MoELayer(cfg, ctx, layer_number=0, seed=3, sequence_parallel=False)
    w = torch.zeros(4, H)
    w[:, 0] = torch.tensor([3.0, 2.0, -2.0, -3.0])
    load_full_(layer.router.weight, w)
    g = torch.Generator().manual_seed(20 + ctx.rank)
    for _ in range(steps):
        x = torch.randn(SKEW_S, SKEW_B, H, generator=g)
        x[..., 0] = torch.where(torch.rand(SKEW_S, SKEW_B, generator=g) < 0.9, 1.0, -1.0)
        x.requires_grad_()
        with ctx.ledger.recording():
            layer(x).square().sum().backward()
        ep_bytes = ctx.ledger.total(group="ep").bytes
    # The forced router sends x0 > 0 to experts 0, 1 (EP rank 0) and x0 < 0 to 3, 2 (rank 1).
    own = int(((x.detach()[..., 0] > 0) == (ctx.ep.rank == 0)).sum()) * 2
    pulled = layer.dispatcher_state.last_stats["pulled"] if dispatcher == "prefetch" else 0
    return ep_bytes, (own + pulled) / (SKEW_S * SKEW_B * 2)


def test_skewed_router_keeps_tokens_local_and_cuts_ep_bytes():
    """90% of the pairs bound for EP rank 0's experts: rank 1 pulls them once its window has
    seen the skew, so the stay-local share of pairs rises and the EP bytes per step fall."""
    a2a = run_ranks(_skewed_bytes, 2, "alltoall", timeout=120)
    pre = run_ranks(_skewed_bytes, 2, "prefetch", timeout=120)
    bytes_a2a, bytes_pre = sum(b for b, _ in a2a), sum(b for b, _ in pre)
    local_a2a, local_pre = sum(s for _, s in a2a) / 2, sum(s for _, s in pre) / 2
    print(f"EP bytes/step: alltoall {bytes_a2a}, prefetch {bytes_pre} ({bytes_pre / bytes_a2a:.3f}x); "
          f"pairs computed on their own rank: alltoall {local_a2a:.3f}, prefetch {local_pre:.3f}")
    assert local_pre > local_a2a + 0.3
    assert bytes_pre < 0.5 * bytes_a2a


def _attention_timeline():
    """EP=2: one forward + backward of a 2-layer MoE GPT chunk, attention recorded as compute."""
    ctx = ParallelContext.build(ep=2)
    cfg = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                      seq_length=8, num_experts=4, moe_top_k=2, moe_token_dispatcher="prefetch",
                      moe_prefetch_policy="pull")
    chunk = GPTChunk(cfg, ctx, seed=3, layer_ids=range(2), pre_process=True, post_process=False)
    for layer in chunk.layers.values():
        forward = layer.attention.forward
        layer.attention.forward = lambda x, *a, _f=forward: timed(ctx.ledger, "attention", _f, x, *a)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(ctx.rank))
    with recording(ctx.ledger) as rec:
        chunk(ids).square().sum().backward()
    states = [m.dispatcher_state for m in moe_layers(chunk)]
    linked = [s.previous is p for s, p in zip(states, [None] + states[:-1])]
    return rec.take(), linked, [len(s.window.affinity) for s in states]


def test_fetch_in_flight_over_attention_and_waited_before_experts():
    for ivs, linked, affinity in run_ranks(_attention_timeline, 2, timeout=120):
        assert linked == [True, True] and affinity == [0, 1]  # layer 1 learns from layer 0
        fetches = [iv for iv in ivs if iv.kind == "prefetch"]
        attention = [iv for iv in ivs if iv.kind == "attention"]
        experts = [iv for iv in ivs if iv.kind == "experts"]
        assert len(fetches) == len(attention) == len(experts) == 2
        pairs = {(id(c), id(w)) for c, w in overlaps(ivs)}
        for fetch, attn, exp in zip(fetches, attention, experts):
            assert (id(fetch), id(attn)) in pairs  # issued before, waited after the attention
            assert fetch.waited <= exp.start  # waited on before the experts run
        assert sum(iv.kind == "prefetch_grad" for iv in ivs) == 2  # the pulled grads go home


def test_prefetch_config_rules_and_alias():
    assert MEGATRON_ALIASES["--moe-token-dispatcher-type"] == "model.moe_token_dispatcher"
    base = dict(model__num_experts=4, model__moe_token_dispatcher="prefetch", parallel__expert=2)
    validate(config_with(**base), 2)
    for extra, field in [(dict(model__moe_pad_to_capacity=True, model__moe_capacity_factor=1.0), "pad_to_capacity"),
                         (dict(model__recompute="full"), "recompute"),
                         (dict(model__moe_prefetch_window=0), "moe_prefetch_window")]:
        with pytest.raises(ConfigError, match=field):
            validate(config_with(**base, **extra), 2)


def test_prefetch_refuses_expert_tp_in_config_validation():
    """parallel.expert_tensor > 1 is refused before launch (it used to pass validation and fail on
    every rank at model build)."""
    base = dict(model__num_experts=4, parallel__expert=2, parallel__expert_tensor=2)
    validate(config_with(**base), 4)  # all-to-all takes expert-TP
    with pytest.raises(ConfigError, match="prefetch.*parallel.expert_tensor=2"):
        validate(config_with(**base, model__moe_token_dispatcher="prefetch"), 4)

def test_routing_window_predicts_through_the_layer_affinity():
    """Layer 0 expert i always led to layer 1 expert (i + 1) % 4: the prediction follows (expert
    3 of layer 0 was never seen, so its token predicts nothing)."""
    w = prefetch.RoutingWindow(4, size=2)
    assert torch.equal(w.predict(None), torch.zeros(4))
    prev = torch.tensor([[0], [0], [1], [2]])
    w.observe((prev + 1) % 4, prev)
    assert torch.equal(w.predict(torch.tensor([[1], [1], [1], [3]])), torch.tensor([0.0, 0.0, 3.0, 0.0]))
    assert torch.equal(w.predict(None), torch.tensor([0.0, 2.0, 1.0, 1.0]))  # own mean counts


def _rank_zero_bubble_pull(world):
    runs = {}
    for zero in (0, 3):
        cfg = wgrad_cfg(world, "zb-h1", ep=2, pp=2, dispatcher="prefetch", zero=zero)
        cfg.model.moe_prefetch_policy = "pull"
        runs[zero] = wgrad_run(cfg)
    return runs


def test_prefetch_zero_bubble_defers_returned_grads():
    """PP=2 x EP=2 zb-h1, pull forced, ZeRO 0 and 3: both grad events of every expert param (its
    own experts' and the pulled copies' coming home) arrive in W actions, and grads, params and
    losses match one process (test_moe_wgrad.py's probe and tolerances)."""
    results = run_ranks(_rank_zero_bubble_pull, 4, 4, timeout=300)
    ref = wgrad_reference()
    for rank, runs in enumerate(results):
        for zero, res in runs.items():
            grads, _ = res["probe"]
            want = sum(".experts." in n for n in res["params"]) * 2 * wgrad_steps * 2
            assert want > 0 and grads == {"W": want}, (rank, zero, grads)
            wgrad_matches(res, ref, f"zero={zero} rank {rank}")
