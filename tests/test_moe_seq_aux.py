"""The sequence-level MoE aux loss (``model.moe_aux_loss_type = "seq"``, DeepSeek-V2): per
sequence, each packed document its own sequence, averaged over the sequences of the global batch.
Its value and the router grads it gives are the same with TP=1 and TP=2 + SP, CP=1 and CP=2 (ring
and all2all), and micro-batch sizes 1, 2 and 3, to 1e-5 relative (fp32), with and without packing.
"""

from __future__ import annotations

import torch

from paratron.config import ModelConfig
from paratron.data.packing import pack_microbatch
from paratron.models.context_parallel import shard_microbatch
from paratron.models.gpt import build_model_chunks
from paratron.models.moe.layer import moe_layers, set_aux_loss_scale
from paratron.models.moe.seq_aux import count_sequences
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

EOD, VOCAB, SEQ, GBS, SEED = 1, 32, 12, 6, 3


def _cfg() -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ,
                       make_vocab_size_divisible_by=8, num_experts=4, moe_top_k=2, moe_aux_loss_coeff=1.0,
                       moe_aux_loss_type="seq")


def _batch(packed: bool) -> dict:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(2, VOCAB, (GBS, SEQ), generator=g)
    if packed:  # 1 to 3 documents per sample, boundaries anywhere
        tokens[torch.rand(GBS, SEQ, generator=g) < 0.15] = EOD
    mb = {"tokens": tokens, "labels": torch.randint(2, VOCAB, (GBS, SEQ), generator=g)}
    return pack_microbatch(mb, EOD, reset_attention_mask=packed, reset_position_ids=packed)


def _run(ctx, *, mbs: int, packed: bool, sp: bool = False, algorithm: str = "ring"):
    """The global batch in microbatches of ``mbs``: (aux value of the global batch, router grad)."""
    (model,) = build_model_chunks(_cfg(), ctx, seed=SEED, sequence_parallel=sp, context_algorithm=algorithm)
    full = _batch(packed)
    micro = [{k: v[i:i + mbs] for k, v in full.items()} for i in range(0, GBS, mbs)]
    n_seq = sum(count_sequences(mb) for mb in micro)
    set_aux_loss_scale(model, 1.0 / n_seq)
    (layer,) = moe_layers(model)
    value = 0.0
    for mb in micro:
        n = count_sequences(mb)
        mb = shard_microbatch(mb, ctx.cp.rank, ctx.cp.size, algorithm)
        extra = {k: mb[k] for k in ("position_ids", "cu_seqlens") if k in mb}
        out = model(mb["tokens"], **extra)
        (0.0 * out.float().sum()).backward()  # only the aux loss reaches the router
        value += float(layer.last_aux_loss) * n / n_seq
    grad = layer.router.weight.grad.clone()
    (ctx.tp_cp if sp else ctx.cp).all_reduce(grad)
    return value, grad


def _ranks():
    out = {}
    for packed in (False, True):
        out[("tp2-sp", packed)] = _run(ParallelContext.build(tp=2), mbs=2, packed=packed, sp=True)
        out[("cp2-ring", packed)] = _run(ParallelContext.build(cp=2), mbs=3, packed=packed)
        out[("cp2-all2all", packed)] = _run(ParallelContext.build(cp=2), mbs=1, packed=packed, algorithm="all2all")
    return out


def test_seq_aux_loss_is_layout_and_microbatch_free():
    """TP=2+SP, CP=2 (ring, all2all) and micro-batch sizes 1, 2, 3 against one process at mbs=1."""
    results = run_ranks(_ranks, 2, timeout=120)
    for packed in (False, True):
        ref_value, ref_grad = _run(ParallelContext.single(), mbs=1, packed=packed)
        assert ref_grad.abs().max() > 1e-3  # the aux loss does reach the router
        runs = {f"mbs={m}": _run(ParallelContext.single(), mbs=m, packed=packed) for m in (2, 3)}
        runs.update({f"{name} rank {r}": res[(name, p)] for r, res in enumerate(results)
                     for (name, p) in res if p == packed})
        for where, (value, grad) in runs.items():
            assert abs(value - ref_value) <= 1e-5 * abs(ref_value), f"packed={packed} {where}: {value} vs {ref_value}"
            torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"packed={packed} {where}: router grad: {m}")


def _step_router_grad(mbs: int, cp: int = 1):
    """Router grad of one training step (``run_global_batch``: LM loss + seq aux loss)."""
    from paratron.config import Config
    from paratron.rules import validate
    from paratron.training.data_iter import microbatch_preparer
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    cfg = Config()
    cfg.model, cfg.data.reset_attention_mask = _cfg(), True
    cfg.parallel.context = cp
    cfg.train.micro_batch_size, cfg.train.global_batch_size = mbs, GBS
    cfg = validate(cfg, cp)
    ctx = ParallelContext.build(cp=cp) if cp > 1 else ParallelContext.single()
    chunks, ddp, opt, _ = build_model_and_optimizer(cfg, ctx)
    prepare = microbatch_preparer(cfg, ctx, EOD)
    full = _batch(packed=True)  # only its tokens and labels: the preparer finds the documents
    micro = [prepare({"tokens": full["tokens"][i:i + mbs], "labels": full["labels"][i:i + mbs]})
             for i in range(0, GBS, mbs)]
    opt.zero_grad()
    run_global_batch(cfg, ctx, chunks, micro, forward_only=False, ddp=ddp)
    (layer,) = moe_layers(chunks[0])
    return layer.router.weight.meta.main_grad.clone()  # final: summed over DP x CP by the step


def _step_rank():
    return _step_router_grad(3, cp=2)


def test_training_step_scales_seq_aux_by_global_sequences():
    """Through the training step (packed documents found by the data loader): micro-batch sizes 1
    and 3, and CP=2, give the same router grads to 1e-5."""
    ref = _step_router_grad(1)
    torch.testing.assert_close(_step_router_grad(3), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run_ranks(_step_rank, 2, timeout=120)[0], ref, rtol=1e-5, atol=1e-6)
