"""Chunked, overlapped all-to-all dispatch (``alltoall_chunked``): the recorded intervals show its
all-to-alls in flight while experts compute, forward and backward; the plain dispatcher shows
none; the pipeline timeline carries the intervals; padding to capacity is refused at validation.

Parity with the plain dispatcher (EP=2 and EP=2 x TP=2, 3 steps, 1e-6) is
``test_moe_layer.py::test_chunked_dispatcher_matches_plain``.

Overlap is checked structurally (:func:`paratron.parallel.intervals.overlaps`: an expert compute
interval lies inside an all-to-all's outstanding window, issue to wait), never by duration.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratron.config import ConfigError, ModelConfig
from paratron.rules import validate
from paratron.models.moe.layer import MoELayer
from paratron.parallel.context import ParallelContext
from paratron.parallel.intervals import Interval, hidden_fraction, overlaps, recording, timed
from paratron.pipeline.actions import Action
from paratron.pipeline.delay import measured_microbatch_time
from paratron.pipeline.runtime import run_pipeline
from paratron.pipeline.timeline import read_chrome_trace, write_chrome_trace
from paratron.local_ranks import run_ranks

from helpers import config_with

S, B, H = 8, 2, 16
FORWARD, BACKWARD = ("dispatch", "combine"), ("dispatch_grad", "combine_grad")


def _cfg(dispatcher: str) -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                       seq_length=S, num_experts=4, moe_top_k=2, moe_token_dispatcher=dispatcher)


def _record_one_step(dispatcher: str):
    """EP=2: one forward + backward of an MoE layer with an interval recorder on the ledger."""
    ctx = ParallelContext.build(ep=2)
    layer = MoELayer(_cfg(dispatcher), ctx, layer_number=0, seed=3, sequence_parallel=False)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(10 + ctx.rank)).requires_grad_()
    with recording(ctx.ledger) as rec:
        layer(x).square().sum().backward()
    return rec.take()


def _pairs(intervals, comm_kinds, compute_kind):
    return [(c, w) for c, w in overlaps(intervals) if c.kind in comm_kinds and w.kind == compute_kind]


def test_timeline_shows_chunked_overlap_and_plain_shows_none():
    chunked = run_ranks(_record_one_step, 2, "alltoall_chunked", timeout=120)
    plain = run_ranks(_record_one_step, 2, "alltoall", timeout=120)
    for ivs in chunked:
        # Forward: chunk 1's dispatch in flight during chunk 0's experts, chunk 0's combine during
        # chunk 1's experts; backward likewise with the swapped all-to-alls and expert backward.
        fwd = {(c.kind, c.chunk, w.chunk) for c, w in _pairs(ivs, FORWARD, "experts")}
        assert {("dispatch", 1, 0), ("combine", 0, 1)} <= fwd, fwd
        bwd = {(c.kind, c.chunk, w.chunk) for c, w in _pairs(ivs, BACKWARD, "experts_grad")}
        assert {("combine_grad", 0, 1), ("dispatch_grad", 1, 0)} <= bwd, bwd
        hidden, total = hidden_fraction(ivs, FORWARD + BACKWARD)
        assert total > 0 and 0 <= hidden <= total
    # Both ranks issue the EP all-to-alls in one order (the process group needs it).
    issue_order = [[(iv.kind, iv.chunk) for iv in ivs if iv.comm] for ivs in chunked]
    assert issue_order[0] == issue_order[1]
    assert issue_order[0][:3] == [("dispatch", 0), ("dispatch", 1), ("combine", 0)]
    for ivs in plain:  # overlap disabled: every all-to-all is waited for before the experts run
        assert any(iv.comm for iv in ivs) and any(iv.kind == "experts_grad" for iv in ivs)
        assert _pairs(ivs, FORWARD + BACKWARD, "experts") + _pairs(ivs, FORWARD + BACKWARD, "experts_grad") == []


def _three_chunks_against_plain():
    """EP=2: the same layer (seed) and input through the plain dispatcher and 3 chunks (16
    tokens -> 6, 6, 4: launches D0 D1 C0 D2 C1 C2)."""
    ctx = ParallelContext.build(ep=2)
    out = []
    for cfg in (_cfg("alltoall"), dataclasses.replace(_cfg("alltoall_chunked"), moe_dispatch_chunks=3)):
        layer = MoELayer(cfg, ctx, layer_number=0, seed=3, sequence_parallel=False)
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(10 + ctx.rank)).requires_grad_()
        y = layer(x)
        y.square().sum().backward()
        out.append((y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    return out


def test_three_chunks_match_plain():
    """Any chunk count (here 3, uneven) gives the plain dispatcher's output and grads (1e-6)."""
    for (y0, gx0, g0), (y1, gx1, g1) in run_ranks(_three_chunks_against_plain, 2, timeout=120):
        tol = dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y1, y0, **tol)
        torch.testing.assert_close(gx1, gx0, **tol)
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], **tol, msg=lambda m: f"{name}: {m}")


def test_overlaps_and_hidden_fraction_on_hand_built_intervals():
    comm = Interval("dispatch", True, start=0.0, end=2.0, waited=5.0)
    inside, late = Interval("experts", False, 1.0, 4.0), Interval("experts", False, 4.5, 6.0)
    ivs = [comm, inside, late]
    assert overlaps(ivs) == [(comm, inside)]
    # Flight [0, 2] (completion, not the wait), compute [1, 4] u [4.5, 6]: 1 s of 2 hidden.
    assert hidden_fraction(ivs) == (1.0, 2.0)
    with pytest.raises(ValueError, match="never waited"):
        hidden_fraction([Interval("combine", True, 0.0)])


class _Timed(torch.nn.Module):
    """A pipeline chunk whose forward is recorded as an "experts" interval."""

    def __init__(self, ctx):
        super().__init__()
        self.ctx, self.w = ctx, torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return timed(self.ctx.ledger, "experts", lambda w: w * x, self.w)


def test_pipeline_timeline_carries_recorded_intervals(tmp_path):
    ctx = ParallelContext.single()
    chunk, events = _Timed(ctx), []
    actions = [Action("F", 0, 0), Action("BW", 0, 0)]
    run_pipeline(actions, [chunk], ctx, [torch.arange(4.0)], lambda c, m, x, mb: m(mb).sum(), [4],
                 torch.float32, timeline=events)
    assert ctx.ledger.intervals is None  # the runtime's own recorder is gone after the run
    lanes = [(e.lane, e.kind, e.microbatch, e.stage) for e in events]
    assert lanes == [("", "F", 0, 0), ("", "BW", 0, 0), ("compute", "experts", 0, 0),
                     ("compute", "experts_grad", 0, 0)]
    f, bw, fwd, bwd = events
    assert f.start <= fwd.start <= fwd.end <= f.end and bw.start <= bwd.start <= bwd.end <= bw.end
    back = read_chrome_trace(write_chrome_trace(events, tmp_path / "t.json"))
    assert [(e.lane, e.kind) for e in back] == [(e.lane, e.kind) for e in events]
    # Consumers of the actions' durations skip the recorded intervals (no double count).
    assert measured_microbatch_time(events, 1) == pytest.approx((f.end - f.start) + (bw.end - bw.start))


def test_chunked_dispatcher_refuses_padding_at_validation():
    """The rule lives in the dispatcher (check_config) and runs in ``validate``, before any
    process group, naming both fields; the layer runs the same rule at construction. The chunk
    count is checked there too."""
    bad = dict(model__num_experts=4, model__moe_token_dispatcher="alltoall_chunked",
               model__moe_capacity_factor=1.0, model__moe_pad_to_capacity=True)
    with pytest.raises(ConfigError, match=r"moe_token_dispatcher=alltoall_chunked .*moe_pad_to_capacity=true"):
        validate(config_with(**bad))
    assert not torch.distributed.is_initialized()
    validate(config_with(**{**bad, "model__moe_token_dispatcher": "alltoall"}))
    validate(config_with(**{**bad, "model__moe_pad_to_capacity": False}))
    with pytest.raises(ConfigError, match="moe_pad_to_capacity"):
        MoELayer(dataclasses.replace(_cfg("alltoall_chunked"), moe_capacity_factor=1.0, moe_pad_to_capacity=True),
                 ParallelContext.single(), layer_number=0, seed=3, sequence_parallel=False)
    with pytest.raises(ConfigError, match="model.moe_token_dispatcher"):
        validate(config_with(model__num_experts=4, model__moe_token_dispatcher="no-such-dispatcher"))
    with pytest.raises(ConfigError, match=r"model.moe_dispatch_chunks=0 must be an integer >= 1"):
        validate(config_with(model__num_experts=4, model__moe_token_dispatcher="alltoall_chunked",
                             model__moe_dispatch_chunks=0))
