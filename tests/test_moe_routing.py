"""Modern routing: dropping by router score, DeepSeek-V3's auxiliary-loss-free expert bias, and
group-limited routing (fp32)."""

from __future__ import annotations

import pytest
import torch

from paratron.checkpoint.manager import CheckpointManager
from paratron.config import CheckpointConfig, Config, ConfigError, ModelConfig
from paratron.config.model_shape import check_moe
from paratron.local_ranks import run_ranks
from paratron.models.gpt import build_model_chunks
from paratron.models.moe.layer import MoELayer, moe_layers, update_expert_bias
from paratron.models.moe.router import TopKRouter, drop_by_score, drop_over_capacity, limit_to_groups
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import load_full_

H = 16


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                seq_length=8, num_experts=8, moe_top_k=2)
    base.update(kw)
    return ModelConfig(**base)


def test_score_dropping_keeps_highest_scoring_pairs():
    """Capacity 1: each expert keeps its best-scoring pair, not its earliest; equal scores keep the
    earlier pair."""
    indices = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 1]])
    scores = torch.tensor([[0.5, 0.3], [0.9, 0.1], [0.6, 0.2], [0.7, 0.4]])
    assert drop_by_score(indices, scores, 1, None).tolist() == [[-1, -1], [0, 2], [1, -1], [3, -1]]
    # The position policy keeps the first pair of each expert instead.
    assert drop_over_capacity(indices, 1, torch.zeros(4)).tolist() == [[0, 1], [-1, 2], [-1, -1], [3, -1]]
    # Capacity 2, ties: experts 0 and 1 have three pairs of equal score each; the two earliest stay.
    tie = torch.tensor([[0.5, 0.1], [0.5, 0.1], [0.1, 0.5], [0.1, 0.1]])
    assert drop_by_score(indices, tie, 2, None).tolist() == [[0, 1], [0, 2], [1, -1], [3, -1]]


def _score_drop_rank(indices, scores, capacity):
    ctx = ParallelContext.build(tp=2)
    n = indices.shape[0] // 2
    mine = slice(ctx.tp.rank * n, (ctx.tp.rank + 1) * n)
    return drop_by_score(indices[mine], scores[mine], capacity, ctx.tp)


def test_score_dropping_is_decided_over_the_stats_group():
    """Two ranks holding halves of a microbatch drop exactly the pairs one process drops."""
    g = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(12)])
    scores = torch.rand(12, 2, generator=g)
    want = drop_by_score(indices, scores, 3, None)
    got = run_ranks(_score_drop_rank, 2, indices, scores, 3, timeout=120)
    assert torch.equal(torch.cat(got), want)


def _skewed_router(rate: float) -> TopKRouter:
    cfg = _cfg(moe_router_score="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=rate)
    router = TopKRouter(cfg, ParallelContext.single(), logical_name="layers.0.mlp.router", seed=1,
                        sequence_parallel=False)
    w = torch.randn(8, H, generator=torch.Generator().manual_seed(2)) * 0.1
    w[:, 0] = torch.linspace(1.5, -1.5, 8)  # feature 0 is always 1: experts 0, 1 are favoured
    load_full_(router.weight, w)
    return router


def _tokens(step: int) -> torch.Tensor:
    x = torch.randn(256, H, generator=torch.Generator().manual_seed(100 + step))
    x[:, 0] = 1.0
    return x


def _max_over_min(load: torch.Tensor) -> float:
    return float(load.max() / load.min().clamp(min=1.0))


def test_expert_bias_balances_a_skewed_router():
    """DeepSeek-V3's bias update: max/min expert load drops >= 2x within 50 steps; the bias
    changes the choice only, the combine weights stay the raw scores of the chosen experts."""
    router = _skewed_router(0.02)
    first = last = None
    for step in range(50):
        routing = router(_tokens(step))
        load = torch.bincount(routing.indices.reshape(-1), minlength=8).float()
        first = _max_over_min(load) if first is None else first
        last = _max_over_min(load)
        update_expert_bias(torch.nn.ModuleList([_Holder(router)]), ParallelContext.single())
    assert first >= 2 * last, (first, last)
    assert router.expert_bias.abs().max() > 0 and not router.expert_bias.requires_grad
    x = _tokens(0)
    routing = router(x)
    raw = torch.sigmoid(x @ router.weight.detach().t()).gather(1, routing.indices)
    torch.testing.assert_close(routing.probs, raw / raw.sum(dim=-1, keepdim=True))


class _Holder(MoELayer):
    """An MoE layer shell around one router, so update_expert_bias finds it."""

    def __init__(self, router):  # noqa: D107  (no MoELayer init: only .router is used)
        torch.nn.Module.__init__(self)
        self.router = router


def test_without_updates_the_bias_is_zero_and_routing_unchanged():
    router = _skewed_router(0.0)
    plain = TopKRouter(_cfg(moe_router_score="sigmoid"), ParallelContext.single(),
                       logical_name="layers.0.mlp.router", seed=1, sequence_parallel=False)
    load_full_(plain.weight, router.weight.detach())
    assert torch.equal(router(_tokens(0)).indices, plain(_tokens(0)).indices)


def _bias_rank(steps):
    ctx = ParallelContext.build(ep=2)
    return _bias_run(ctx, [ctx.dp.rank], steps)


def _bias_run(ctx, mbs, steps):
    cfg = _cfg(num_experts=4, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1)
    layer = MoELayer(cfg, ctx, layer_number=0, seed=5, sequence_parallel=False)
    for step in range(steps):
        for m in mbs:
            x = torch.randn(8, 2, H, generator=torch.Generator().manual_seed(10 * step + m)).requires_grad_()
            layer(x).sum().backward()
        update_expert_bias(layer, ctx)
    return layer.router.expert_bias.detach().clone()


def test_expert_bias_update_parity_ep2():
    """EP=2 (DP=2): both ranks hold the bias one process gets from both microbatches (bitwise)."""
    want = _bias_run(ParallelContext.single(), [0, 1], 3)
    assert want.abs().max() > 0
    for got in run_ranks(_bias_rank, 2, 3, timeout=120):
        assert torch.equal(got, want)


def test_expert_bias_restored_bitwise(tmp_path):
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 16, 2, 8, 40
    m.ffn_hidden_size, m.num_experts, m.moe_top_k, m.moe_router_enable_expert_bias = 32, 4, 2, True
    ctx = ParallelContext.single()
    chunks = build_model_chunks(m, ctx, seed=1)
    for i, layer in enumerate(moe_layers(chunks)):
        layer.router.update_bias(torch.randn(4, generator=torch.Generator().manual_seed(i)))
        layer.router.update_bias(torch.randn(4, generator=torch.Generator().manual_seed(9 + i)))
        layer.router.expert_bias.mul_(1.0 / 3.0)  # not exactly representable sums
    saved = [l.router.expert_bias.detach().clone() for l in moe_layers(chunks)]
    cfg.checkpoint.save = str(tmp_path)
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(1, chunks, None, None, {})
    fresh = build_model_chunks(m, ctx, seed=2)
    assert all(l.router.expert_bias.abs().max() == 0 for l in moe_layers(fresh))
    CheckpointManager(CheckpointConfig(load=str(tmp_path), load_optimizer=False), ctx, cfg).load(fresh, None, None)
    for want, layer in zip(saved, moe_layers(fresh)):
        assert torch.equal(layer.router.expert_bias, want)


def test_group_limited_routing_picks_within_best_groups():
    """8 experts in 4 groups, 2 groups per token, k=2: a group scores its best expert; the global
    top-2 (experts 0 and 2, different groups) stays; when three groups tie for second, the
    lowest wins."""
    scores = torch.tensor([[0.9, 0.8, 0.85, 0.1, 0.3, 0.2, 0.0, 0.0],
                           [0.1, 0.2, 0.6, 0.7, 0.65, 0.0, 0.9, 0.1]])
    limited = limit_to_groups(scores, 4, 2, 2)
    assert torch.isinf(limited[0, 4:]).all() and torch.isfinite(limited[0, :4]).all()
    # Row 1: groups score 0.2, 0.7, 0.65, 0.9 -> groups 3 and 1.
    assert torch.isfinite(limited[1]).tolist() == [False, False, True, True, False, False, True, True]
    cfg = _cfg(moe_router_num_groups=4, moe_router_group_topk=2, moe_top_k=3)
    router = TopKRouter(cfg, ParallelContext.single(), logical_name="layers.0.mlp.router", seed=1,
                        sequence_parallel=False)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3))
    groups = router(x).indices // 2
    assert max(len(set(row)) for row in groups.tolist()) <= 2
    free = TopKRouter(_cfg(moe_top_k=3), ParallelContext.single(), logical_name="layers.0.mlp.router", seed=1,
                      sequence_parallel=False)
    assert max(len(set(row)) for row in (free(x).indices // 2).tolist()) == 3  # the limit did something


@pytest.mark.parametrize("kw,match", [
    (dict(moe_router_num_groups=4), "go together"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "divide model.num_experts"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=3), "group_topk=3"),
    (dict(moe_router_num_groups=8, moe_router_group_topk=1, moe_top_k=2), "moe_top_k=2 exceeds"),
    (dict(moe_router_bias_update_rate=-1.0), "bias_update_rate"),
])
def test_routing_config_rules(kw, match):
    with pytest.raises(ConfigError, match=match):
        check_moe(_cfg(**kw), tp=1, ep=1, expert_tp=1)


def test_training_step_updates_the_expert_bias():
    """The real training step (DDP, pipeline runtime, optimizer) runs with the frozen bias and
    moves it once per global batch."""
    from paratron.rules import validate
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    cfg = Config()
    m, t, o = cfg.model, cfg.train, cfg.optimizer
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.vocab_size = 2, 16, 2, 32, 32
    m.seq_length, m.num_experts, m.moe_top_k, m.moe_router_enable_expert_bias = 8, 4, 2, True
    t.micro_batch_size, t.global_batch_size, o.name = 1, 2, "sgd"
    cfg = validate(cfg, 1)
    ctx = ParallelContext.single()
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    mbs = [{"tokens": tokens[i:i + 1], "labels": tokens[i:i + 1]} for i in range(2)]
    optimizer.zero_grad()
    run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, loss_scale=1.0, ddp=ddp)
    optimizer.step()
    biases = [l.router.expert_bias for l in moe_layers(chunks)]
    assert len(biases) == 2 and all(b.abs().max() == pytest.approx(1e-3) for b in biases)
    assert all(l.router.step_load.sum() == 0 for l in moe_layers(chunks))
