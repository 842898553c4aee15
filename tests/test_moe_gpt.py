"""A tiny MoE GPT (4 experts, top-2, MoE in every layer) trained through the real stack: model
chunks, DDP / ZeRO-1, the pipeline runtime and the training step, with SGD, against one process.

Layouts: EP=1 with DP=2, EP=2, EP=4, EP=2 with TP=2 (SP on and off), with PP=2, with ZeRO-1, with
expert-TP=2, with full recompute, and the all-gather dispatcher. Each rank trains on its DP share of the same global batch (4 samples,
microbatches of 1), so every microbatch holds the same tokens as on one process and the aux loss
(a per-microbatch quantity) means the same. SGD with lr 0.5 and no decay: the first update is
``-lr * grad``, so the expert grads are compared through it (to 1e-5; a double reduction would
show as a ratio of 2), and the params after two steps to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import Config
from paratron.rules import validate
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

GBS, SEQ, VOCAB, LR, STEPS = 4, 8, 32, 0.5, 2


def _config(tp=1, ep=1, pp=1, sp=False, zero=0, dispatcher="alltoall", world=1, recompute="none",
            aux=0.01, etp=1) -> Config:
    cfg = Config()
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 16, 2, 32
    m.vocab_size, m.seq_length, m.make_vocab_size_divisible_by = VOCAB, SEQ, 8
    m.num_experts, m.moe_top_k, m.moe_token_dispatcher = 4, 2, dispatcher
    m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.recompute = aux, 0.001, recompute
    p.tensor, p.expert, p.pipeline, p.sequence_parallel, p.zero = tp, ep, pp, sp, zero
    p.expert_tensor = etp
    p.bucket_size_mb = 0.001
    t.micro_batch_size, t.global_batch_size, t.seed = 1, GBS, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "sgd", LR, 0.0, 0.0, "constant"
    return validate(cfg, world)


def _batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return (torch.randint(0, VOCAB, (GBS, SEQ), generator=g),
            torch.randint(0, VOCAB, (GBS, SEQ), generator=g))


def _snapshot(chunks, ddp) -> dict[str, tuple[torch.Tensor, tuple]]:
    out = {}
    with ddp.full_params():  # ZeRO-3 keeps only param shards between uses
        for c in chunks:
            for p in c.parameters():
                out[p.meta.logical_name] = (p.meta.shard.valid(p).detach().clone(), p.meta.shard.slices())
    return out


def _train(cfg: Config, ctx) -> dict:
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    torch.manual_seed(0)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    dp, r, mbs = ctx.dp.size, ctx.dp.rank, cfg.train.micro_batch_size
    rows = GBS // dp
    before = _snapshot(chunks, ddp)
    history = []
    for step in range(STEPS):
        tokens, labels = _batch(step)
        tokens, labels = tokens[r * rows:(r + 1) * rows], labels[r * rows:(r + 1) * rows]
        microbatches = [{"tokens": tokens[i:i + mbs], "labels": labels[i:i + mbs]} for i in range(0, rows, mbs)]
        optimizer.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, microbatches, forward_only=False,
                               loss_scale=optimizer.loss_scale, ddp=ddp)
        optimizer.step()
        history.append((out.loss, out.aux_loss))
        if step == 0:
            after1 = _snapshot(chunks, ddp)
    first_update = {n: ((before[n][0] - after1[n][0]) / LR, before[n][1]) for n in before}
    return {"update": first_update, "params": _snapshot(chunks, ddp), "history": history}


def _rank(kw, world):
    cfg = _config(world=world, **kw)
    p = cfg.parallel
    ctx = ParallelContext.build(tp=p.tensor, ep=p.expert, pp=p.pipeline, expert_tp=p.expert_tensor)
    out = _train(cfg, ctx)
    out["coords"] = (ctx.tp.rank, ctx.dp.rank, ctx.pp.rank)
    return out


def _reference(dispatcher="alltoall"):
    return _train(_config(dispatcher=dispatcher), ParallelContext.single())


LAYOUTS = {
    "ep1-dp2": (2, dict()),
    "ep2": (2, dict(ep=2)),
    "ep4": (4, dict(ep=4)),
    "ep2-tp2-sp": (4, dict(ep=2, tp=2, sp=True)),
    "ep2-tp2": (4, dict(ep=2, tp=2)),
    "ep2-pp2": (4, dict(ep=2, pp=2)),
    "ep2-dp4-zero1": (4, dict(ep=2, zero=1)),
    "ep2-allgather": (2, dict(ep=2, dispatcher="allgather")),
    # Experts run once per token chunk: DDP must wait for every chunk's grad (param.meta.grad_uses).
    "ep2-chunked": (2, dict(ep=2, dispatcher="alltoall_chunked")),
    "ep2-pp2-chunked": (4, dict(ep=2, pp=2, dispatcher="alltoall_chunked")),
    "ep2-recompute": (2, dict(ep=2, recompute="full")),
    "ep2-etp2-tp2-sp": (4, dict(ep=2, etp=2, tp=2, sp=True)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_gpt_parity(name):
    world, kw = LAYOUTS[name]
    results = run_ranks(_rank, world, kw, world, timeout=240)
    ref = _reference(kw.get("dispatcher", "alltoall"))
    seen = set()
    for res in results:
        for n, (upd, slices) in res["update"].items():
            want = ref["update"][n][0][slices]
            torch.testing.assert_close(upd, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} grad {n}: {m}")
            if ".experts." in n and want.norm() > 1e-3:
                assert abs(float(upd.norm() / want.norm()) - 1.0) < 1e-3, f"{name}: grad scale of {n}"
        for n, (p, slices) in res["params"].items():
            torch.testing.assert_close(p, ref["params"][n][0][slices], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{name} param {n}: {m}")
            seen.add(n)
        last = [h for h in res["history"]]
        for (loss, aux), (rloss, raux) in zip(last, ref["history"]):
            assert loss == pytest.approx(rloss, rel=1e-5)
    # Router replicas on the TP ranks of one (dp, pp) coordinate stay bitwise equal.
    for a in results:
        for b in results:
            if a["coords"][1:] == b["coords"][1:]:
                for n, (p, _) in a["params"].items():
                    if n.endswith("router.weight"):
                        assert torch.equal(p, b["params"][n][0]), f"{name}: {n} differs across TP"
    # Every logical param of the model lives on some rank (all experts included).
    assert seen == set(ref["params"])
    assert any(".experts.3.fc2.weight" in n for n in seen)


def test_aux_loss_grad_scale_in_training_step():
    """The training step scales the aux-loss grads so that the step's grads equal autograd of
    ``LM token mean + coeff * mean over microbatches of (aux + z-loss terms)`` (one process,
    4 microbatches, a large coefficient so a wrong scale shows), to 1e-6."""
    from paratron.models.gpt import build_model_chunks
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    cfg = _config(aux=0.5)
    ctx = ParallelContext.single()
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    tokens, labels = _batch(0)
    microbatches = [{"tokens": tokens[i:i + 1], "labels": labels[i:i + 1]} for i in range(GBS)]
    optimizer.zero_grad()
    run_global_batch(cfg, ctx, chunks, microbatches, forward_only=False, loss_scale=1.0, ddp=ddp)
    got = {p.meta.logical_name: p.meta.main_grad.clone() for c in chunks for p in c.parameters()}

    ref_cfg = _config(aux=0.0)
    ref_cfg.model.moe_z_loss_coeff = 0.0
    (ref,) = build_model_chunks(ref_cfg.model, ctx, seed=ref_cfg.train.seed)
    terms = []
    for m in ref.modules():
        if type(m).__name__ == "TopKRouter":
            m.register_forward_hook(lambda mod, args, out: terms.append(0.5 * out.aux_loss + 0.001 * out.z_loss))
    total = 0.0
    for mb in microbatches:
        total = total + ref(mb["tokens"], labels=mb["labels"]).sum() / (GBS * SEQ)
    assert len(terms) == GBS * cfg.model.num_layers
    (total + sum(terms) / GBS).backward()
    for p in ref.parameters():
        torch.testing.assert_close(got[p.meta.logical_name], p.grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{p.meta.logical_name}: {m}")
