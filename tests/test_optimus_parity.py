"""The vision-language model under both encoder placements matches one process (fp32, 1e-5, 3
SGD steps): ``stage0`` (Megatron: the encoder on stage 0's rank) and ``optimus`` (an encoder
replica on every pipeline rank, its parts in the 1F1B bubbles, its grads summed over pp x dp),
at PP=2, PP=4 and PP=2 x DP=2 under 1F1B, and at PP=2 under ZB-H1 (split backward: stage 0's
``B`` leaves the encoder output's grad). Losses per step, every grad of every step, and the final weights
are compared, and a forward-only pass after them; the encoder replicas stay equal."""

from __future__ import annotations

import pytest
import torch

from paratron.config import ModelConfig
from paratron.data.image_text import patchify, synthetic_image_text
from paratron.models.gpt import GPTChunk
from paratron.models.vlm import (EncoderConfig, VisionEncoder, VLMFirstStage, build_vlm_chunks, reduce_encoder_grads,
                                 vlm_labels)
from paratron.optim import finalize_grads
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import unique_params
from paratron.pipeline.encoder_runtime import EncoderRun
from paratron.pipeline.encoder_schedule import place_encoder
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.runtime import run_pipeline
from paratron.pipeline.simulator import Costs
from paratron.pipeline.validate import validate
from paratron.local_ranks import run_ranks

TOL = 1e-5
SEED, STEPS, LR, GLOBAL_BATCH = 5, 3, 0.5, 8
IMAGE, PATCH, TEXT, VOCAB, HIDDEN, LAYERS = 8, 4, 8, 64, 16, 4
NPATCH = (IMAGE // PATCH) ** 2


def _cfg() -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=VOCAB,
                       seq_length=NPATCH + TEXT, normalization="rmsnorm", position_embedding_type="rope",
                       activation="swiglu", add_bias_linear=False, tie_embeddings=False)


def _encoder() -> VisionEncoder:
    return VisionEncoder(EncoderConfig(num_patches=NPATCH, patch_dim=3 * PATCH * PATCH), HIDDEN, seed=SEED)


def _batch(step: int, lo: int = 0, hi: int = GLOBAL_BATCH):
    data = synthetic_image_text(range(step * GLOBAL_BATCH + lo, step * GLOBAL_BATCH + hi), seed=SEED,
                                image_size=IMAGE, text_length=TEXT, vocab_size=VOCAB)
    return patchify(data.images, PATCH), data.text, vlm_labels(data.text, NPATCH)


def _total(step: int) -> int:
    return int((_batch(step)[2] != -100).sum())


def _name(p) -> str:
    meta = getattr(p, "meta", None)
    return getattr(p, "logical_name", None) or meta.logical_name


def _sgd(params) -> None:
    with torch.no_grad():
        for p in params:
            p.sub_(LR * p.grad)
            p.grad = None


def _reference():
    """One process, the whole global batch: losses, grads by name per step, final weights."""
    ctx = ParallelContext.single()
    encoder = _encoder()
    model = VLMFirstStage(_cfg(), ctx, seed=SEED, chunk=GPTChunk(_cfg(), ctx, seed=SEED, layer_ids=range(LAYERS),
                                                                  pre_process=False, post_process=True))
    params = list(encoder.parameters()) + unique_params([model])
    history = []
    for step in range(STEPS):
        patches, text, labels = _batch(step)
        loss = model(text, encoder(patches), labels).sum() / _total(step)
        loss.backward()
        history.append((float(loss.detach()), {_name(p): p.grad.clone() for p in params}))
        _sgd(params)
    with torch.no_grad():
        patches, text, labels = _batch(STEPS)
        evaluated = float(model(text, encoder(patches), labels).sum() / _total(STEPS))
    return history, {_name(p): p.detach().clone() for p in params}, evaluated


def _rank(p, dp, placement, parts, m, schedule):
    ctx = ParallelContext.build(pp=p)
    chunks = build_vlm_chunks(_cfg(), ctx, seed=SEED, layers_per_stage=[LAYERS // p] * p)
    encoder = _encoder() if placement == "optimus" or ctx.pp.rank == 0 else None
    costs = Costs(EF=0.2 * p, EB=0.4 * p, encoder_parts=parts)
    lists = place_encoder(build_schedule(schedule, p, m), placement, costs)
    validate(lists, m)
    params = unique_params(chunks) + (list(encoder.parameters()) if encoder is not None else [])
    run = (ctx, lists[ctx.pp.rank], chunks, encoder, m, parts, dp)
    history = []
    for step in range(STEPS):
        loss = _step(*run, step)
        finalize_grads(chunks, ctx)
        for q in unique_params(chunks):
            ctx.dp.all_reduce(q.grad)
        if encoder is not None:
            reduce_encoder_grads(encoder, [ctx.pp, ctx.dp] if placement == "optimus" else [ctx.dp])
        history.append((loss, {_name(q): q.grad.clone() for q in params}))
        _sgd(params)
    evaluated = _step(*run, STEPS, forward_only=True)
    return history, {_name(q): q.detach().clone() for q in params}, ctx.pp.rank == p - 1, evaluated


def _step(ctx, actions, chunks, encoder, m, parts, dp, step, forward_only=False) -> float:
    """One pipelined step (or forward-only pass) over this DP rank's share of global batch
    ``step``; the loss summed over DP (on the last stage's ranks; 0 elsewhere)."""
    local = GLOBAL_BATCH // dp
    mbs = local // m
    patches, text, labels = _batch(step, ctx.dp.rank * local, (ctx.dp.rank + 1) * local)
    micro = [(i, text[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(m)]
    inputs = [torch.tensor_split(patches[i * mbs:(i + 1) * mbs], parts) for i in range(m)]
    enc = EncoderRun(encoder, inputs, lambda mb, k: (NPATCH, inputs[mb][k].shape[0], HIDDEN), ctx)
    total = _total(step)

    def forward_step(c, chunk, x, mb):
        i, ids, lab = mb
        if ctx.pp.rank == 0:
            return chunk(ids, enc.features(i), lab if chunk.post_process else None)
        return chunk(x, lab).sum() / total if chunk.post_process else chunk(x)

    losses = run_pipeline(actions, chunks, ctx, micro, forward_step, (NPATCH + TEXT, mbs, HIDDEN), torch.float32,
                          encoder=enc, forward_only=forward_only)
    loss = torch.stack(losses).sum() if losses else torch.zeros(())
    ctx.dp.all_reduce(loss)
    return float(loss)


def _check(results, ref_history, ref_final, ref_evaluated):
    last = next(r for r, res in enumerate(results) if res[2])  # a rank holding the loss
    assert abs(results[last][3] - ref_evaluated) <= TOL, (results[last][3], ref_evaluated)  # forward only
    seen = set()
    for step, (ref_loss, ref_grads) in enumerate(ref_history):
        got = results[last][0][step][0]
        assert abs(got - ref_loss) <= TOL, (step, got, ref_loss)
        for hist, _, _, _ in results:
            for name, g in hist[step][1].items():
                torch.testing.assert_close(g, ref_grads[name], atol=TOL, rtol=0, msg=f"step {step} grad {name}")
                seen.add(name)
    assert seen == set(ref_grads), set(ref_grads) ^ seen
    for _, final, _, _ in results:
        for name, w in final.items():
            torch.testing.assert_close(w, ref_final[name], atol=TOL, rtol=0, msg=f"final {name}")


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.mark.parametrize("placement", ["stage0", "optimus"])
@pytest.mark.parametrize("p,dp,parts,m,schedule", [(2, 1, 2, 4, "1f1b"), (4, 1, 1, 4, "1f1b"),
                                                   (2, 2, 1, 4, "1f1b"), (2, 1, 1, 4, "zb-h1")])
def test_vlm_matches_one_process(reference, placement, p, dp, parts, m, schedule):
    results = run_ranks(_rank, p * dp, p, dp, placement, parts, m, schedule, timeout=300)
    _check(results, *reference)
    if placement == "optimus":  # the encoder really is spread: some part runs off stage 0
        lists = place_encoder(build_schedule(schedule, p, m), placement, Costs(EF=0.2 * p, EB=0.4 * p,
                                                                              encoder_parts=parts))
        assert any(a.kind == "EF" for acts in lists[1:] for a in acts)
