"""Context parallelism against one process: a tiny Llama-style GPT (RoPE, GQA, SwiGLU) and a tiny
GPT-2-style MoE (learned positions, 4 experts top-2, dropless) trained for 3 AdamW steps through
the real stack (model chunks, DDP / ZeRO-1, the pipeline runtime, the training step, the data
loader's CP split), for both ``parallel.context_algorithm`` values.

Layouts: CP=2 (also with activation recompute) and CP=4 alone; CP=2 with TP=2 + SP, with PP=2 (1F1B and interleaved), with DP=2 +
ZeRO-1, and with the MoE at EP=2. The losses, grad norms and params after 3 steps match one process
(SDPA attention, whole sequences) to 1e-5 relative (fp32; Adam eps 1e-5, see ``_config``).
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import Config
from paratron.rules import validate
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

GBS, SEQ, VOCAB, STEPS = 4, 16, 32, 3


def _config(*, cp=1, algorithm="ring", tp=1, sp=False, pp=1, schedule="1f1b", v=1, zero=0, moe=False, ep=1,
            recompute="none", world=1) -> Config:
    cfg = Config()
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    m.num_layers, m.vocab_size, m.seq_length, m.make_vocab_size_divisible_by = 4, VOCAB, SEQ, 8
    if moe:  # GPT-2 style: learned positions (global positions under CP), MoE in every layer
        m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 16, 4, 32
        m.num_experts, m.moe_top_k, m.moe_aux_loss_coeff, m.moe_z_loss_coeff = 4, 2, 0.01, 0.001
    else:     # Llama style: RoPE (global positions under CP), GQA
        m.hidden_size, m.num_attention_heads, m.num_query_groups = 32, 8, 4
        m.normalization, m.position_embedding_type, m.activation = "rmsnorm", "rope", "swiglu"
        m.add_bias_linear, m.tie_embeddings = False, False
    m.recompute = recompute
    p.context, p.context_algorithm, p.tensor, p.sequence_parallel = cp, algorithm, tp, sp
    p.pipeline, p.schedule, p.virtual_pipeline, p.zero, p.expert = pp, schedule, v, zero, ep
    p.bucket_size_mb = 0.001
    t.micro_batch_size, t.global_batch_size, t.seed = 1, GBS, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 0.0, "constant"
    # Adam's first steps move every element by ~lr whatever its grad's size: an element whose grad
    # is ~1e-9 (round-off of a sum that cancels) would turn rounding differences of the attention
    # merge into 1e-5 param differences. eps = 1e-5 keeps such elements still; grads of 1e-4 and
    # more (nearly all) get the plain Adam step.
    o.adam_eps = 1e-5
    return validate(cfg, world)


def _batch(step: int):
    g = torch.Generator().manual_seed(70 + step)
    tokens = torch.randint(0, VOCAB, (GBS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GBS, SEQ), generator=g)
    labels[torch.rand(GBS, SEQ, generator=g) < 0.2] = -100
    return tokens, labels


def _snapshot(chunks) -> dict[str, tuple[torch.Tensor, tuple]]:
    return {p.meta.logical_name: (p.meta.shard.valid(p).detach().clone(), p.meta.shard.slices())
            for c in chunks for p in c.parameters()}


def _train(cfg: Config, ctx) -> dict:
    from paratron.training.data_iter import microbatch_preparer
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    torch.manual_seed(0)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    prepare = microbatch_preparer(cfg, ctx, eod=0)
    dp, r, mbs = ctx.dp.size, ctx.dp.rank, cfg.train.micro_batch_size
    rows = GBS // dp
    history = []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        tokens, labels = tokens[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows]
        mbs_ = [prepare({"tokens": tokens[i:i + mbs], "labels": labels[i:i + mbs]}) for i in range(0, rows, mbs)]
        optimizer.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, mbs_, forward_only=False, loss_scale=optimizer.loss_scale,
                               ddp=ddp)
        res = optimizer.step()
        history.append((out.loss, res.grad_norm))
    return {"params": _snapshot(chunks), "history": history}


def _rank(layouts, world):
    outs = []
    for kw in layouts:
        cfg = _config(world=world, **kw)
        p = cfg.parallel
        ctx = ParallelContext.build(tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline)
        outs.append(_train(cfg, ctx))
    return outs


def _check(results, layouts):
    refs = {}
    for i, kw in enumerate(layouts):
        moe = kw.get("moe", False)
        if moe not in refs:
            refs[moe] = _train(_config(moe=moe), ParallelContext.single())
        ref, seen = refs[moe], set()
        for rank_out in results:
            res = rank_out[i]
            for (loss, norm), (rloss, rnorm) in zip(res["history"], ref["history"]):
                assert loss == pytest.approx(rloss, rel=1e-5), f"{kw}: loss {loss} vs {rloss}"
                assert norm == pytest.approx(rnorm, rel=1e-5), f"{kw}: grad norm {norm} vs {rnorm}"
            for n, (p, slices) in res["params"].items():
                torch.testing.assert_close(p, ref["params"][n][0][slices], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{kw} param {n}: {m}")
                seen.add(n)
        assert seen == set(ref["params"]), kw


BOTH = ("ring", "all2all")
WORLD2 = [dict(cp=2, algorithm=a) for a in BOTH] + [
    dict(cp=2, algorithm="ring", recompute="full"), dict(cp=2, algorithm="all2all", recompute="selective")]
WORLD4 = [dict(cp=4, algorithm=a) for a in BOTH] + [
    kw | dict(cp=2, algorithm=a) for a in BOTH for kw in (
        dict(tp=2, sp=True),
        dict(pp=2),
        dict(pp=2, schedule="interleaved", v=2),
        dict(zero=1),
        dict(moe=True, ep=2),
    )]


def test_cp2_alone():
    """CP=2 (ring and all2all, also under full / selective recompute) on 2 ranks: 3 AdamW steps
    match one process to 1e-5."""
    _check(run_ranks(_rank, 2, WORLD2, 2, timeout=300), WORLD2)


def test_cp_compositions_world4():
    """CP=4 alone, and CP=2 with TP=2+SP, PP=2 (1F1B, interleaved), DP=2+ZeRO-1 and a MoE at EP=2,
    each with ring and all2all: 3 AdamW steps match one process to 1e-5."""
    _check(run_ranks(_rank, 4, WORLD4, 4, timeout=600), WORLD4)


MORE = [dict(cp=2, pp=2, schedule="gpipe"), dict(cp=2, pp=2, schedule="zb-h1", algorithm="all2all"),
        dict(cp=2, pp=2, schedule="zbv", v=2), dict(cp=2, tp=2), dict(cp=2, tp=2, algorithm="all2all"),
        dict(cp=2, tp=2, moe=True), dict(cp=2, tp=2, sp=True, moe=True, ep=2)]


@pytest.mark.slow
def test_cp_more_compositions_world4():
    """CP=2 with PP=2 under GPipe, ZB-H1 (deferred weight grads) and ZBV; with TP=2 without SP
    (dense and MoE); MoE with TP=2+SP and EP=2: parity to 1e-5."""
    _check(run_ranks(_rank, 4, MORE, 4, timeout=900), MORE)
