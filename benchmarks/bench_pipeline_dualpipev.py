"""DualPipeV against ZBV and 1F1B at PP=4, m=8 on the CPU, fixed-cost stages: measured makespan
of the pipeline runtime and the simulator's prediction for the same lists.

Fixed cost (as ``bench_pipeline_delay.py``): each pipeline stage of 1F1B is one small transformer
layer plus ``--f-ms`` of sleep in its forward, ``--b-ms`` in its input-grad backward (B) and
``--w-ms`` in its weight-grad part (W; run in B for a full backward, deferred to the W action
when the runtime defers, through the chunk's weight-grad store). The V schedules hold two chunks
per rank, each half a stage: half of each cost. So the timed difference is the schedules' waits,
not how 4 ranks share loaded cores. The model has no MoE all-to-all, so DualPipeV's FB pairs
run their halves one after the other: the measured case is the simulator's no-overlap one; the
table also gives the simulated makespan when a quarter of each F and B is all-to-all that a pair
hides (``overlap.DEFAULT_COSTS``). Makespan: end of the last action of any rank, the ranks
starting together after a barrier; medians over ``--repeats`` steps, the schedules taking turns.
A per-action overhead fitted on the measured 1F1B step (the layers' own compute and the p2p host
work, large on a loaded machine) is added to every action for a calibrated prediction of the
other two.

Usage::

    .venv/bin/python benchmarks/bench_pipeline_dualpipev.py [--repeats 5 --f-ms 20 --b-ms 20 --w-ms 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_pipeline_delay import _makespan  # noqa: E402
from paratron.config import ModelConfig  # noqa: E402
from paratron.models.gpt import build_model_chunks  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.pipeline.partition import stage_layers  # noqa: E402
from paratron.pipeline.registry import build_schedule  # noqa: E402
from paratron.pipeline.runtime import run_pipeline  # noqa: E402
from paratron.pipeline.simulator import Costs, simulate  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

VOCAB, P, HIDDEN, SEQ, MBS = 128, 4, 32, 16, 1
SCHEDULES = (("1f1b", 1), ("zbv", 2), ("dualpipev", 2))


class _Sleep(torch.autograd.Function):
    """Identity: sleeps ``f`` s in forward, ``b`` s in backward, and ``w`` s as a weight grad
    (deferred to the W action while ``store`` defers)."""

    @staticmethod
    def forward(ctx, x, f, b, w, store):
        ctx.b, ctx.w, ctx.store = b, w, store
        time.sleep(f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b)
        if ctx.store is not None and ctx.store.deferring:
            ctx.store.put(lambda: time.sleep(ctx.w))
        else:
            time.sleep(ctx.w)
        return grad, None, None, None, None


class FixedCost(nn.Module):
    """A chunk's fixed cost; ``weight_grad_store`` is set by the runtime (it defers W here)."""

    def __init__(self, f: float, b: float, w: float) -> None:
        super().__init__()
        self.f, self.b, self.w, self.weight_grad_store = f, b, w, None

    def forward(self, x):
        return _Sleep.apply(x, self.f, self.b, self.w, self.weight_grad_store)


def _rank(a):
    ctx = ParallelContext.build(pp=P)
    ids = torch.randint(0, VOCAB, (a.microbatches * MBS, SEQ), generator=torch.Generator().manual_seed(0))
    micro = [(ids[i * MBS:(i + 1) * MBS],) * 2 for i in range(a.microbatches)]
    out = {}
    for name, v in SCHEDULES:
        cfg = ModelConfig(num_layers=P * v, hidden_size=HIDDEN, num_attention_heads=2, vocab_size=VOCAB,
                          seq_length=SEQ)
        chunks = build_model_chunks(cfg, ctx, seed=1, stage_layers=stage_layers(P * v, P, v, None, name))
        for c in chunks:
            c.fixed_cost = FixedCost(a.f_ms / 1e3 / v, a.b_ms / 1e3 / v, a.w_ms / 1e3 / v)
        out[name] = (build_schedule(name, P, a.microbatches, v), chunks)

    def step(c, chunk, x, mb):
        y = chunk(mb[0] if x is None else x, mb[1] if chunk.post_process else None)
        return chunk.fixed_cost(y.sum() / ids.numel() if chunk.post_process else y)

    def run(name):
        lists, chunks = out[name]
        timeline = []
        dist.barrier()
        run_pipeline(lists[ctx.pp.rank], chunks, ctx, micro, step, (SEQ, MBS, HIDDEN), torch.float32,
                     timeline=timeline)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        everyone = [None] * P
        dist.all_gather_object(everyone, timeline)
        return _makespan([e for events in everyone for e in events if e.lane == ""])

    for name, _ in SCHEDULES:
        run(name)  # gloo's first messages take seconds: not timed
    got = {name: [] for name, _ in SCHEDULES}
    for s in range(a.repeats):
        for name, _ in (SCHEDULES if s % 2 else SCHEDULES[::-1]):
            got[name].append(run(name))
    return {name: statistics.median(v) for name, v in got.items()}


def simulated(a, name: str, v: int, comm: float, overhead: float = 0.0) -> float:
    """Simulated makespan (s) of ``name``'s lists with the fixed costs per chunk plus ``overhead``
    s per compute action (an FB pays it twice, once per half); ``comm``: the fraction of F and B
    that is all-to-all an FB pair can hide."""
    f, b, w = a.f_ms / 1e3 / v, a.b_ms / 1e3 / v, a.w_ms / 1e3 / v
    o = overhead
    costs = Costs(F=f + o, B=b + o, W=w + o, BW=b + w + o, comm_F=comm * f, comm_B=comm * b)
    return simulate(build_schedule(name, P, a.microbatches, v), costs).makespan


def fitted_overhead(a, measured_1f1b: float) -> float:
    """The per-action time (the layers' real compute, the p2p host work, a loaded machine waking
    a rank) that makes the simulator reproduce the measured 1F1B step: bisection."""
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(a, "1f1b", 1, 0.0, mid) < measured_1f1b else (lo, mid)
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("microbatches", 8), ("repeats", 5), ("f-ms", 20.0), ("b-ms", 20.0), ("w-ms", 20.0)):
        ap.add_argument(f"--{name}", type=type(default), default=default)
    a = ap.parse_args()
    load = os.getloadavg()
    measured = run_ranks(_rank, P, a, timeout=1800)[0]
    print(f"load average before {load}, after {os.getloadavg()}; PP={P}, m={a.microbatches}, fixed cost per "
          f"stage F {a.f_ms} ms, B {a.b_ms} ms, W {a.w_ms} ms (V schedules: half per chunk); "
          f"medians of {a.repeats} steps")
    o = fitted_overhead(a, measured["1f1b"])
    print(f"per-action overhead fitted on the measured 1f1b step: {o * 1e3:.1f} ms")
    print("| schedule | measured (s) | simulated (s) | simulated + fitted overhead (s) | measured / that | "
          "simulated, 1/4 of F and B hidden by FB pairs (s) | measured / 1f1b measured |")
    print("|---|---|---|---|---|---|---|")
    for name, v in SCHEDULES:
        sim, fit, hidden = simulated(a, name, v, 0.0), simulated(a, name, v, 0.0, o), simulated(a, name, v, 0.25)
        print(f"| {name} | {measured[name]:.3f} | {sim:.3f} | {fit:.3f} | {measured[name] / fit:.3f} | "
              f"{hidden:.3f} | {measured[name] / measured['1f1b']:.3f} |")


if __name__ == "__main__":
    main()
