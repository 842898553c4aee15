"""Vocab-parallel embedding, output layer and cross-entropy.

* Cross-entropy on vocab-split logits against ``torch.nn.functional.cross_entropy`` on the full
  logits in fp64, with ``ignore_index`` and label smoothing 0.1, at logit scales 1 and 1000:
  loss and logit grads within 1e-6 (relative to the largest magnitude), identical on every TP
  rank, finite; padded columns get exactly zero grad.
* GPT-2's vocab (50257, not divisible by TP) at TP=2 and TP=4 gives the TP=1 loss to 1e-5, with
  a tied and an untied output layer, with and without sequence parallelism.
* All-ignored microbatches give a zero, finite loss and zero grads; with DP, a rank whose labels
  are all ignored leaves the mean over the other ranks' valid tokens.
"""

import pytest
import torch
import torch.nn.functional as F

from paratron.layers import (LayerNorm, ParallelLMHead, VocabParallelEmbedding, pad_vocab_size,
                             vocab_parallel_cross_entropy, vocab_parallel_logits)
from paratron.layers.init import full_init
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

SEED = 7
IGNORE = -100


# ---- cross-entropy against the fp64 reference --------------------------------------------
CE_VOCAB, CE_DIV, S, B = 250, 16, 6, 3  # padded to 256 at TP=1/2/4: the last rank has 6 pad cols


def _ce_inputs(scale):
    padded = pad_vocab_size(CE_VOCAB, 4, CE_DIV)
    logits = full_init((S, B, padded), SEED, f"ce.logits.{scale}", 1.0) * scale
    g = torch.Generator().manual_seed(SEED)
    labels = torch.randint(0, CE_VOCAB, (S, B), generator=g)
    labels[0, :] = IGNORE
    labels[2, 1] = IGNORE
    labels[3, 0] = CE_VOCAB - 1  # the last true class, next to the padding
    return logits, labels, torch.randn(S, B, generator=g)  # per-token upstream grads


def _ce_reference(scale, smoothing):
    logits, labels, up = _ce_inputs(scale)
    full = logits[..., :CE_VOCAB].double().requires_grad_(True)
    loss = F.cross_entropy(full.reshape(-1, CE_VOCAB), labels.reshape(-1), ignore_index=IGNORE,
                           label_smoothing=smoothing, reduction="none").view(S, B)
    (loss * up.double()).sum().backward()
    return loss.detach(), full.grad


def _ce_case(ctx, scale, smoothing):
    logits, labels, up = _ce_inputs(scale)
    tp, r = ctx.tp.size, ctx.tp.rank
    per = logits.shape[-1] // tp
    mine = logits[..., r * per:(r + 1) * per].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(mine, labels, ctx, CE_VOCAB, ignore_index=IGNORE,
                                        label_smoothing=smoothing)
    (loss * up).sum().backward()
    return loss.detach(), mine.grad


CE_CASES = [(scale, smoothing) for scale in (1.0, 1000.0) for smoothing in (0.0, 0.1)]


def _ce_rank(tp):
    ctx = ParallelContext.build(tp=tp)
    return {case: _ce_case(ctx, *case) for case in CE_CASES}


def _check_ce(per_rank, scale, smoothing):
    ref_loss, ref_grad = _ce_reference(scale, smoothing)
    loss0 = per_rank[0][0]
    for loss, _ in per_rank:
        assert torch.equal(loss, loss0), "loss differs across TP ranks"
    grad = torch.cat([g for _, g in per_rank], dim=-1)
    assert torch.isfinite(loss0).all() and torch.isfinite(grad).all()
    assert loss0.dtype == torch.float32
    assert (loss0[0] == 0).all() and loss0[2, 1] == 0, "ignored positions must have zero loss"
    err = (loss0.double() - ref_loss).abs().max() / ref_loss.abs().max()
    assert err <= 1e-6, f"scale {scale} smoothing {smoothing}: loss rel err {err:.2e}"
    err = (grad[..., :CE_VOCAB].double() - ref_grad).abs().max() / ref_grad.abs().max()
    assert err <= 1e-6, f"scale {scale} smoothing {smoothing}: grad rel err {err:.2e}"
    assert torch.count_nonzero(grad[..., CE_VOCAB:]) == 0, "padded columns must get exactly zero grad"
    assert torch.count_nonzero(grad[0]) == 0, "ignored positions must get zero grad"


@pytest.mark.parametrize("scale,smoothing", CE_CASES)
def test_cross_entropy_single_matches_fp64_reference(scale, smoothing):
    _check_ce([_ce_case(ParallelContext.single(), scale, smoothing)], scale, smoothing)


@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_tp_matches_fp64_reference(tp):
    results = run_ranks(_ce_rank, tp, tp, timeout=180)
    for case in CE_CASES:
        _check_ce([r[case] for r in results], *case)


def test_cross_entropy_rejects_bad_labels():
    ctx = ParallelContext.single()
    logits = torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match="model.vocab_size=5"):
        vocab_parallel_cross_entropy(logits, torch.tensor([[1], [6]]), ctx, 5)
    with pytest.raises(ValueError, match="leading dims"):
        vocab_parallel_cross_entropy(logits, torch.tensor([1, 2]), ctx, 5)


# ---- GPT-2 vocab, embedding -> norm -> tied or untied logits -> loss ------------------------
V, H, SEQ, BATCH = 50257, 16, 8, 2


def _lm(ctx, sp, tied):
    emb = VocabParallelEmbedding(V, H, ctx, logical_name="embedding.word", seed=SEED, sequence_parallel=sp)
    norm = LayerNorm(H, ctx, logical_name="final_norm", sequence_parallel=sp)
    head = None if tied else ParallelLMHead(V, H, ctx, logical_name="output", seed=SEED, sequence_parallel=sp)
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, V, (BATCH, SEQ), generator=g)
    ids[0, 0] = V - 1  # a token in the last rank's rows, next to the padding
    labels = torch.randint(0, V, (BATCH, SEQ), generator=g)
    labels[1, 3] = V - 1
    hidden = norm(emb(ids))
    logits = vocab_parallel_logits(hidden, emb.weight, ctx, sp) if tied else head(hidden)
    logits.retain_grad()
    # Logits are [s, b, V_pad/tp] on the full sequence even under SP (the SP gather precedes them).
    loss = vocab_parallel_cross_entropy(logits, labels.t(), ctx, V).sum() / labels.numel()
    loss.backward()
    weight = emb.weight if tied else head.weight
    return {"loss": loss.detach(), "padded": emb.padded_vocab_size,
            "pad_logit_grad": logits.grad[..., max(0, V - emb.vocab_start):],
            "weight_grad": weight.grad, "weight_shard": weight.meta.shard,
            "emb_grad": emb.weight.grad, "emb_shard": emb.weight.meta.shard}


VOCAB_CASES = [(sp, tied) for sp in (False, True) for tied in (True, False)]


def _vocab_rank(tp):
    ctx = ParallelContext.build(tp=tp)
    return {case: _lm(ctx, *case) for case in VOCAB_CASES}


def _gather_rows(results, key, spec_key):
    full = torch.full((V, H), float("nan"))
    for r in results:
        spec = r[spec_key]
        full[spec.slices()] = spec.valid(r[key])
    return full


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt2_vocab_loss_matches_single_process(tp):
    single = ParallelContext.single()
    results = run_ranks(_vocab_rank, tp, tp, timeout=180)
    for sp, tied in VOCAB_CASES:
        ref = _lm(single, False, tied)
        per = [r[(sp, tied)] for r in results]
        assert per[0]["padded"] == pad_vocab_size(V, tp, 128) and per[0]["padded"] % (128 * tp) == 0
        for r in per:
            assert torch.equal(r["loss"], per[0]["loss"]), "loss differs across TP ranks"
            assert torch.count_nonzero(r["pad_logit_grad"]) == 0, "padded logits got a gradient"
        err = ((per[0]["loss"] - ref["loss"]).abs() / ref["loss"].abs()).item()
        assert err <= 1e-5, f"tp={tp} sp={sp} tied={tied}: loss rel err {err:.2e}"
        for key, spec in (("weight_grad", "weight_shard"), ("emb_grad", "emb_shard")):
            full = _gather_rows(per, key, spec)
            assert not torch.isnan(full).any()
            want = ref[key][:V]
            assert torch.count_nonzero(ref[key][V:]) == 0, "TP=1 padding rows got a gradient"
            gerr = (full - want).abs().max() / want.abs().max()
            assert gerr <= 1e-5, f"tp={tp} sp={sp} tied={tied}: {key} rel err {gerr:.2e}"
        last = per[-1]
        n_valid = last["emb_shard"].local_shape[0]
        assert torch.count_nonzero(last["emb_grad"][n_valid:]) == 0, "padding rows got a gradient"


def test_padded_rows_are_zero_and_outside_the_shard():
    emb = VocabParallelEmbedding(300, 4, ParallelContext.single(), logical_name="e", seed=1,
                                 make_vocab_size_divisible_by=128)
    assert emb.padded_vocab_size == 384 and emb.weight.shape == (384, 4)
    assert emb.weight.meta.shard.local_shape == (300, 4) and emb.weight.meta.shard.global_shape == (300, 4)
    assert torch.count_nonzero(emb.weight[300:]) == 0
    assert torch.equal(emb.weight[:300], full_init((300, 4), 1, "e.weight", 0.02))


# ---- all-ignored microbatches, alone and under DP ----------------------------------------
def _all_ignored(ctx):
    logits = full_init((4, 2, 64), SEED, "ignored.logits", 1.0).requires_grad_(True)
    labels = torch.full((4, 2), IGNORE)
    loss = vocab_parallel_cross_entropy(logits, labels, ctx, 60)
    valid = (labels != IGNORE).sum()
    # The caller divides by max(count, 1) only when the whole global batch is empty.
    total = loss.sum() / valid.clamp(min=1)
    total.backward()
    return loss.detach(), total.detach(), logits.grad


def test_all_ignored_microbatch_single():
    loss, total, grad = _all_ignored(ParallelContext.single())
    assert torch.equal(loss, torch.zeros(4, 2)) and total.item() == 0.0
    assert torch.isfinite(grad).all() and torch.count_nonzero(grad) == 0


def _dp_rank():
    ctx = ParallelContext.build(tp=2)  # 4 ranks: tp=2, dp=2
    loss_single, total_single, grad_single = _all_ignored(ctx)
    logits_full = full_init((4, 2, 64), SEED, "dp.logits", 2.0)
    g = torch.Generator().manual_seed(SEED)
    labels = torch.randint(0, 60, (4, 2), generator=g)
    labels[1, 1] = IGNORE
    if ctx.dp.rank == 1:
        labels.fill_(IGNORE)
    per = 64 // ctx.tp.size
    logits = logits_full[..., ctx.tp.rank * per:(ctx.tp.rank + 1) * per].clone().requires_grad_(True)
    losses = vocab_parallel_cross_entropy(logits, labels, ctx, 60)
    # The loss normalisation contract: sum over the global batch / global valid-token count.
    stats = torch.stack([losses.sum(), (labels != IGNORE).sum().float()])
    ctx.dp.all_reduce(stats)
    (losses.sum() / stats[1]).backward()
    return {"global": (stats[0] / stats[1]).item(), "grad": logits.grad, "dp": ctx.dp.rank,
            "single": (loss_single, total_single, grad_single)}


def test_all_ignored_dp_rank_leaves_mean_of_the_others():
    results = run_ranks(_dp_rank, 4, timeout=180)
    logits = full_init((4, 2, 64), SEED, "dp.logits", 2.0)
    g = torch.Generator().manual_seed(SEED)
    labels = torch.randint(0, 60, (4, 2), generator=g)
    labels[1, 1] = IGNORE
    want = F.cross_entropy(logits[..., :60].double().reshape(-1, 60), labels.reshape(-1),
                           ignore_index=IGNORE).item()
    for r in results:
        assert abs(r["global"] - want) <= 1e-6 * abs(want), (r["global"], want)
        assert torch.isfinite(r["grad"]).all()
        loss, total, grad = r["single"]
        assert torch.equal(loss, torch.zeros(4, 2)) and total.item() == 0.0 and torch.count_nonzero(grad) == 0
        if r["dp"] == 1:
            assert torch.count_nonzero(r["grad"]) == 0
        else:
            assert torch.count_nonzero(r["grad"]) > 0


def test_cross_entropy_computes_in_fp32_for_bf16_logits():
    ctx = ParallelContext.single()
    logits, labels, up = _ce_inputs(1.0)
    low = logits.to(torch.bfloat16).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(low, labels, ctx, CE_VOCAB, ignore_index=IGNORE)
    (loss * up).sum().backward()
    ref = low.detach()[..., :CE_VOCAB].double().requires_grad_(True)
    want = F.cross_entropy(ref.reshape(-1, CE_VOCAB), labels.reshape(-1), ignore_index=IGNORE,
                           reduction="none").view(S, B)
    (want * up.double()).sum().backward()
    assert loss.dtype == torch.float32 and low.grad.dtype == torch.bfloat16
    assert (loss.double() - want).abs().max() / want.abs().max() <= 1e-6
    torch.testing.assert_close(low.grad[..., :CE_VOCAB].double(), ref.grad.to(torch.bfloat16).double())
    assert torch.count_nonzero(low.grad[..., CE_VOCAB:]) == 0
