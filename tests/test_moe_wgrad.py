"""MoE expert weight grads in zero-bubble schedules, and expert-DP buckets reduced during backward.

The tiny MoE GPT of ``test_moe_gpt`` (4 experts, top-2, SGD lr 0.5, 2 steps of 4 samples) trained
through the real stack, with probes on three internals, installed in the ranks only:

* the pipeline runtime's ``compute`` notes which action (``F``/``B``/``W``/``BW``) is running;
* DDP's grad-ready entry counts the grad events of expert params per action kind (a weight
  grad reaches DDP when its GEMM has run, so this counts the expert weight-grad GEMMs; biases
  follow the same path);
* DDP's bucket launch (ZeRO-2's bucket flush) notes the action it happened in (None: at
  finalisation, after the schedule).

Must show: at PP=2 x EP=2 with zb-h1 and zbv every expert weight (and bias) grad is computed in a
``W`` action, never in ``B``, and the run matches one process to 1e-5 (grads through the first SGD
update, params after 2 steps, losses); at EP=2 x DP=4 (expert-DP 2) every expert bucket starts
its reduction inside the last backward action of the step with overlap on, and the params are
bitwise equal to overlap off (ZeRO-2's expert buckets flush during backward too, equal to 1e-6).
Both also with the chunked dispatcher, which runs the experts twice per microbatch (their params
declare ``grad_uses = 2``, so DDP waits for the second grad before reducing).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from paratron.rules import validate
from paratron.optim.ddp import DistributedDataParallel
from paratron.optim.zero import ShardedGrads
from paratron.parallel.context import ParallelContext
from paratron.pipeline.runtime import _Run
from paratron.local_ranks import run_ranks
from test_moe_gpt import STEPS, _config, _train

LAYERS = 4  # zbv runs 4 virtual stages on 2 ranks: one layer each


class _Probe:
    """Where expert weight grads are computed and where each DP bucket's reduction starts."""

    def __init__(self) -> None:
        self.action: str | None = None
        self.expert_grads: Counter = Counter()   # action kind -> expert weight grad events
        self.launches: list[tuple[bool, str | None]] = []  # (expert bucket, action kind)

    @contextmanager
    def installed(self):
        probe = self
        saved = (_Run.compute, DistributedDataParallel._grad_ready, DistributedDataParallel._launch,
                 ShardedGrads._flush)

        def compute(run, a):
            probe.action = a.kind
            try:
                saved[0](run, a)
            finally:
                probe.action = None

        def grad_ready(ddp, p):
            if ".experts." in p.meta.logical_name:
                probe.expert_grads[probe.action] += 1
            saved[1](ddp, p)

        def launch(ddp, i, bucket):
            probe.launches.append((ddp.buffers[i].is_expert, probe.action))
            saved[2](ddp, i, bucket)

        def flush(sharded, i, k):
            probe.launches.append((sharded.buffers[i].is_expert, probe.action))
            saved[3](sharded, i, k)

        _Run.compute, DistributedDataParallel._grad_ready = compute, grad_ready
        DistributedDataParallel._launch, ShardedGrads._flush = launch, flush
        try:
            yield self
        finally:
            (_Run.compute, DistributedDataParallel._grad_ready, DistributedDataParallel._launch,
             ShardedGrads._flush) = saved


def _cfg(world, schedule="1f1b", overlap=True, gemm="auto", **kw):
    cfg = _config(world=world, **kw)
    cfg.model.num_layers, cfg.model.moe_expert_gemm = LAYERS, gemm
    cfg.parallel.schedule, cfg.parallel.overlap_grad_reduce = schedule, overlap
    cfg.parallel.virtual_pipeline = 2 if schedule == "zbv" else 1
    return validate(cfg, world)


def _run(cfg):
    p = cfg.parallel
    ctx = ParallelContext.build(tp=p.tensor, ep=p.expert, pp=p.pipeline, expert_tp=p.expert_tensor)
    with _Probe().installed() as probe:
        out = _train(cfg, ctx)
    out["probe"] = (dict(probe.expert_grads), probe.launches)
    return out


CHUNKED = "alltoall_chunked"  # runs the experts once per dispatch chunk: 2 grads per backward


def _rank_zero_bubble(world):
    # zbv runs the experts as grouped GEMMs (the CPU default is the per-expert loop).
    return {(s, d, z): _run(_cfg(world, s, ep=2, pp=2, dispatcher=d, zero=z, gemm="bmm" if s == "zbv" else "auto"))
            for s, d, z in (("zb-h1", "alltoall", 0), ("zbv", "alltoall", 0), ("zb-h1", CHUNKED, 0),
                            ("zb-h1", "alltoall", 3))}


def _rank_overlap(world):
    return {(zero, overlap, d): _run(_cfg(world, overlap=overlap, ep=2, zero=zero, dispatcher=d))
            for zero, overlap, d in ((0, True, "alltoall"), (0, False, "alltoall"), (2, True, "alltoall"),
                                     (0, True, CHUNKED))}


def _reference():
    return _train(_cfg(1), ParallelContext.single())


def _assert_matches(res, ref, where):
    for n, (upd, slices) in res["update"].items():
        torch.testing.assert_close(upd, ref["update"][n][0][slices], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{where} grad {n}: {m}")
    for n, (p, slices) in res["params"].items():
        torch.testing.assert_close(p, ref["params"][n][0][slices], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{where} param {n}: {m}")
    for (loss, _), (rloss, _) in zip(res["history"], ref["history"]):
        assert loss == pytest.approx(rloss, rel=1e-5), where


def _expert_params(res) -> int:
    return sum(".experts." in n for n in res["params"])


def test_zero_bubble_defers_expert_weight_grads():
    """PP=2 x EP=2 (DP=2), 2 microbatches per rank: zb-h1, zbv with grouped expert GEMMs, zb-h1
    with the chunked dispatcher (the experts run twice per microbatch) and zb-h1 with ZeRO-3 (its W
    actions run with the layer's params freed). Every expert weight grad of every microbatch
    arrives in a W action (none in B), every expert bucket starts its reduction inside the stage's
    last W, and grads, params and losses match one process to 1e-5 (the experts have biases)."""
    results = run_ranks(_rank_zero_bubble, 4, 4, timeout=300)
    ref = _reference()
    microbatches = 2
    for rank, per_schedule in enumerate(results):
        for (schedule, dispatcher, zero), res in per_schedule.items():
            where = f"{schedule} {dispatcher} zero={zero} rank {rank}"
            grads, launches = res["probe"]
            calls = 2 if dispatcher == CHUNKED else 1
            want = _expert_params(res) * microbatches * STEPS * calls
            assert want > 0 and grads == {"W": want}, f"{where}: expert grads by action {grads}"
            expert = [action for is_expert, action in launches if is_expert]
            assert expert and set(expert) == {"W"}, f"{where}: expert buckets launched in {expert}"
            _assert_matches(res, ref, where)


def test_expert_buckets_reduce_during_backward_bitwise():
    """EP=2 x DP=4 (expert-DP 2), 1 microbatch per rank: with overlap on every expert bucket
    starts its reduction inside the step's backward action (BW), with overlap off at
    finalisation; the params after 2 steps are bitwise equal and match one process to 1e-5.
    ZeRO-2 flushes its expert buckets during backward too, and so does DDP under the chunked
    dispatcher (two grads per expert param per backward), both equal to plain DDP to 1e-6."""
    results = run_ranks(_rank_overlap, 4, 4, timeout=300)
    ref = _reference()
    for rank, runs in enumerate(results):
        for (zero, overlap, dispatcher), res in runs.items():
            where = f"zero={zero} overlap={overlap} {dispatcher} rank {rank}"
            expert = [action for is_expert, action in res["probe"][1] if is_expert]
            assert expert and set(expert) == ({"BW"} if overlap else {None}), f"{where}: {expert}"
            _assert_matches(res, ref, where)
        on, off = runs[(0, True, "alltoall")], runs[(0, False, "alltoall")]
        for n, (p, _) in on["params"].items():
            assert torch.equal(p, off["params"][n][0]), f"rank {rank}: {n} differs with overlap off"
            for other in (runs[(2, True, "alltoall")], runs[(0, True, CHUNKED)]):
                torch.testing.assert_close(other["params"][n][0], p, rtol=1e-6, atol=1e-6)
