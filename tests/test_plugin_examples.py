"""The example plugins under examples/plugins/, loaded as ``train.callbacks`` loads them:

* ``custom_schedule.py`` registers ``gpipe-lifo``, which the config accepts, ``build_schedule``
  proves, and which at PP=2 gives GPipe's losses and grads (fp32, 1e-6);
* ``custom_dispatcher.py`` registers ``sorted_local``, whose MoE layer output and grads equal the
  built-in all-to-all dispatcher's at EP=1 (fp32, 1e-6), and which refuses EP > 1.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from paratron.config import ModelConfig
from paratron.local_ranks import run_ranks
from paratron.models.moe.layer import MoELayer
from paratron.optim import finalize_grads
from paratron.parallel.context import ParallelContext
from paratron.pipeline.registry import build_schedule
from paratron.rules import validate
from paratron.training.callbacks import import_callback_module, load_callback

from helpers import config_with
from test_pipeline_runtime import _build, _grads_by_name, _pipeline_step

PLUGINS = Path(__file__).resolve().parents[1] / "examples" / "plugins"
SCHEDULE = f"{PLUGINS / 'custom_schedule.py'}:Registered"
DISPATCHER = f"{PLUGINS / 'custom_dispatcher.py'}:Registered"
TOL = 1e-6


def _schedule_rank(m):
    import_callback_module(SCHEDULE)  # each forked rank imports the plugin, as training does
    ctx = ParallelContext.build(pp=2)
    out = {}
    for name in ("gpipe", "gpipe-lifo"):
        chunks = _build(ctx, name, 1)
        losses = _pipeline_step(ctx, chunks, name, m, 1)
        finalize_grads(chunks, ctx)
        out[name] = ([x.item() for x in losses], _grads_by_name(chunks))
    return out


def test_custom_schedule_plugin_registers_validates_and_matches_gpipe():
    load_callback(SCHEDULE, SimpleNamespace())  # the train.callbacks path: import, then instantiate
    cfg = config_with(parallel__pipeline=2, parallel__schedule="gpipe-lifo", model__num_layers=4,
                      train__micro_batch_size=1, train__global_batch_size=4)
    validate(cfg, world_size=2)  # the name is known once the plugin is imported
    lists = build_schedule("gpipe-lifo", 2, 4)
    assert [a.microbatch for a in lists[0] if a.kind == "BW"] == [3, 2, 1, 0]
    for rank_out in run_ranks(_schedule_rank, 2, 4, timeout=240):
        ref_losses, ref_grads = rank_out["gpipe"]
        losses, grads = rank_out["gpipe-lifo"]
        assert losses == pytest.approx(ref_losses, abs=TOL)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert (grads[name] - g).abs().max().item() < TOL, name


def _moe_layer(dispatcher: str) -> MoELayer:
    cfg = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                      seq_length=8, num_experts=4, moe_top_k=2, moe_token_dispatcher=dispatcher)
    return MoELayer(cfg, ParallelContext.single(), layer_number=0, seed=7, sequence_parallel=False)


def test_custom_dispatcher_plugin_matches_alltoall():
    load_callback(DISPATCHER, SimpleNamespace())
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(3))
    out = {}
    for name in ("alltoall", "sorted_local"):
        layer, xi = _moe_layer(name), x.clone().requires_grad_(True)
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        out[name] = (y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()})
    (y0, g0, p0), (y1, g1, p1) = out["alltoall"], out["sorted_local"]
    torch.testing.assert_close(y1, y0, rtol=0, atol=TOL)
    torch.testing.assert_close(g1, g0, rtol=0, atol=TOL)
    assert p1.keys() == p0.keys()
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], rtol=0, atol=TOL, msg=lambda m: f"{n}: {m}")


def test_custom_dispatcher_refuses_expert_parallelism():
    module = import_callback_module(DISPATCHER)
    ctx = SimpleNamespace(ep=SimpleNamespace(size=2, rank=0))
    with pytest.raises(ValueError, match="parallel.expert=1"):
        module.SortedLocalDispatcher(ctx, 4)
