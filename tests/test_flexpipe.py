"""Token-balanced variable-length microbatches (``data.microbatch_tokens``) against one process,
on the lognormal corpus (:mod:`paratron.data.lognormal`): a tiny Llama-style GPT trained for 3
AdamW steps through the real stack (DDP, the pipeline runtime with a different activation shape
per microbatch, the training step). PP=2 (1F1B), DP=2, TP=2 with sequence parallelism and CP=2
(ring and all2all; rows padded to a multiple of the split) match one process reading the same
documents (grouped into other microbatches under DP: the plan depends on DP) to 1e-5 relative,
fp32; so do PP=2 and DP=2 of a GPT-2-style model (learned positions, restarting per document in
rows longer than the position table; tied embeddings).
Exact resume through ``run_training`` at PP=2: tests/test_flexpipe_resume.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paratron.config import Config
from paratron.rules import validate
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

VOCAB, S, N, G, STEPS, DOCS = 64, 256, 512, 8, 3, 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    from paratron.data.lognormal import write_lognormal_dataset

    prefix = str(tmp_path_factory.mktemp("lognormal") / "ln")
    write_lognormal_dataset(prefix, DOCS, VOCAB, eod=0, seed=4)
    return prefix


def _config(pp: int = 1, world: int = 1, tp: int = 1, cp: int = 1, algorithm: str = "ring",
            gpt2: bool = False) -> Config:
    cfg = Config()
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    m.num_layers, m.vocab_size, m.seq_length, m.make_vocab_size_divisible_by = 2, VOCAB, S, 8
    m.hidden_size, m.num_attention_heads = 32, 4
    if gpt2:  # learned positions (the table has S rows; a row is up to N > S positions long), tied
        m.normalization, m.position_embedding_type, m.activation = "layernorm", "learned", "gelu"
        m.add_bias_linear, m.tie_embeddings = True, True
    else:     # Llama style: RoPE (relative: a position shift within a document changes nothing), GQA
        m.num_query_groups = 2
        m.normalization, m.position_embedding_type, m.activation = "rmsnorm", "rope", "swiglu"
        m.add_bias_linear, m.tie_embeddings = False, False
    p.pipeline, p.tensor, p.sequence_parallel, p.bucket_size_mb = pp, tp, tp > 1, 0.001
    p.context, p.context_algorithm = cp, algorithm
    t.global_batch_size, t.seed, cfg.data.microbatch_tokens = G, 1234, N
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "adamw", 1e-2, 0.1, 0.0, "constant"
    o.adam_eps = 1e-5  # as in tests/test_cp_parity.py: round-off-sized grads do not take whole Adam steps
    return validate(cfg, world)


def _train(cfg: Config, ctx, prefix: str) -> dict:
    from paratron.data.indexed import IndexedDataset
    from paratron.config.token_rules import row_multiple
    from paratron.data.token_batches import DocumentSource, TokenBudgetSampler, collate_pieces
    from paratron.training.data_iter import microbatch_preparer
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    torch.manual_seed(0)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    src = DocumentSource(IndexedDataset(prefix), np.arange(DOCS))
    sampler = TokenBudgetSampler(src.lengths, G, N, S, ctx.dp.rank, ctx.dp.size, seed=1)
    prepare = microbatch_preparer(cfg, ctx, eod=0)
    history, rows = [], []
    for step in range(STEPS):
        # rows padded for the SP / CP splits, then this CP rank's chunks (as the data loader does)
        mbs = [prepare(collate_pieces(pieces, src.read, row_multiple(cfg.parallel)))
               for pieces in sampler.step(step * G)]
        rows.append([mb["tokens"].shape[1] for mb in mbs])
        optimizer.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, ddp=ddp)
        res = optimizer.step()
        history.append((out.loss, res.grad_norm, out.num_tokens))
    params = {p.meta.logical_name: (p.meta.shard.valid(p).detach().clone(), p.meta.shard.slices())
              for c in chunks for p in c.parameters()}
    return {"history": history, "rows": rows, "params": params}


LAYOUTS = {"pp=2": dict(pp=2), "dp=2": dict(pp=1), "tp=2+sp": dict(tp=2), "cp=2 ring": dict(cp=2),
           "cp=2 all2all": dict(cp=2, algorithm="all2all"), "gpt2 pp=2": dict(pp=2, gpt2=True),
           "gpt2 dp=2": dict(pp=1, gpt2=True)}


def _rank(prefix: str):
    outs = []
    for kw in LAYOUTS.values():
        ctx = ParallelContext.build(tp=kw.get("tp", 1), cp=kw.get("cp", 1), ep=1, pp=kw.get("pp", 1))
        outs.append(_train(_config(world=2, **kw), ctx, prefix))
    return outs


def test_pp2_and_dp2_match_one_process(corpus):
    refs = {gpt2: _train(_config(gpt2=gpt2), ParallelContext.single(), corpus) for gpt2 in (False, True)}
    ref = refs[False]
    from paratron.data.indexed import IndexedDataset
    from paratron.data.token_batches import TokenBudgetSampler

    lengths = IndexedDataset(corpus).document_lengths
    stream = TokenBudgetSampler(lengths, G, N, S, seed=1).stream
    for step, (_, _, n) in enumerate(ref["history"]):  # every label of the step's documents counts
        assert n == int((lengths[stream(step * G, G)] - 1).sum())
    results = run_ranks(_rank, 2, corpus, timeout=300)
    for i, layout in enumerate(LAYOUTS):
        ref = refs[LAYOUTS[layout].get("gpt2", False)]
        for rank_out in results:
            res = rank_out[i]
            assert any(len(set(r)) > 1 for r in res["rows"]), f"{layout}: every microbatch had one shape"
            for step, ((loss, norm, n), (rloss, rnorm, rn)) in enumerate(zip(res["history"], ref["history"])):
                assert n == rn, f"{layout} step {step}: {n} tokens vs {rn}"  # exact global token count
                assert loss == pytest.approx(rloss, rel=1e-5), f"{layout} step {step}: loss {loss} vs {rloss}"
                assert norm == pytest.approx(rnorm, rel=1e-5), f"{layout} step {step}: grad norm {norm} vs {rnorm}"
            for name, (p, slices) in res["params"].items():
                torch.testing.assert_close(p, ref["params"][name][0][slices], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{layout} param {name}: {m}")
    # the DP=2 ranks split each step's documents: different groupings than one process
    assert results[0][1]["rows"] != refs[False]["rows"]
