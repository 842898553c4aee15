"""Optimus (Feng et al., USENIX ATC 2025) against Megatron's encoder-on-stage-0 placement: bubble
fill and step ratio, simulated and measured with fixed-cost stages at PP=4.

Simulated (unit F, B, W per stage; the encoder costs 15, 20 or 30% of the LLM's ``3p`` per
microbatch, a third of it forward): for 1F1B, interleaved (v=2), ZB-H1 and ZB-V at p=4, m=8,
the step of each placement (:func:`~paratron.pipeline.encoder_schedule.place_encoder`), the
LLM-only step, and the *bubble fill*: the share of the encoder's work that the Optimus lists
run without lengthening the LLM-only step, ``1 - p * (step_optimus - step_llm) / encoder_work``.

Measured: 4 gloo ranks run 1F1B lists with each placement. Every stage is a small linear layer
followed by a sleep of ``--f-ms`` in its forward and ``--b-ms`` in its backward; the encoder is
a small linear layer followed by a sleep of ``share * p * (f + b) / 3`` in its forward and twice
that in its backward (as ``bench_pipeline_delay.py`` does, so what is timed is the schedules, not
how 4 ranks share 2 loaded cores). The placements take turns for ``--repeats`` steps each (after
one untimed step each). The prediction replays the same lists in the simulator with each (kind,
stage)'s mean duration from that step's own timeline (the encoder's per kind). Makespan: end of
the last action on any rank, from the ranks' common start after a barrier. Medians.

Usage::

    .venv/bin/python benchmarks/bench_optimus.py [--microbatches 8 --repeats 3 --f-ms 20 --b-ms 40 --share 0.2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.pipeline.encoder_runtime import EncoderRun  # noqa: E402
from paratron.pipeline.encoder_schedule import place_encoder  # noqa: E402
from paratron.pipeline.registry import build_schedule  # noqa: E402
from paratron.pipeline.runtime import run_pipeline  # noqa: E402
from paratron.pipeline.simulator import Costs, simulate  # noqa: E402
from paratron.pipeline.validate import validate  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

P, HIDDEN, SEQ, MBS = 4, 16, 8, 2
SIMULATED = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


class FixedCost(torch.autograd.Function):
    """Identity that sleeps ``f`` seconds in forward and ``b`` in backward."""

    @staticmethod
    def forward(ctx, x, f, b):
        ctx.b = b
        time.sleep(f)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.b)
        return grad, None, None


class Timed(nn.Module):
    def __init__(self, f: float, b: float):
        super().__init__()
        self.linear, self.f, self.b = nn.Linear(HIDDEN, HIDDEN), f, b

    def forward(self, x):
        return FixedCost.apply(self.linear(x), self.f, self.b)


def simulated(m: int) -> list[tuple]:
    rows = []
    for share in (0.15, 0.2, 0.3):
        for name, v in SIMULATED:
            costs = Costs(F=1 / v, B=1 / v, W=1 / v, EF=share * P, EB=2 * share * P)
            base = build_schedule(name, P, m, v)
            llm = simulate(base, costs)
            got = {pl: simulate(place_encoder(base, pl, costs), costs) for pl in ("stage0", "optimus")}
            work = m * (costs.EF + costs.EB)
            fill = 1 - P * (got["optimus"].makespan - llm.makespan) / work
            rows.append((share, name, llm.makespan, got["stage0"].makespan, got["optimus"].makespan,
                         statistics.mean(llm.bubble), statistics.mean(got["optimus"].bubble), fill))
    return rows


def _predict(lists, timeline) -> float:
    seen = defaultdict(list)
    for e in timeline:
        key = (e.kind, 0) if e.kind in ("EF", "EB") else (e.kind, e.stage)
        seen[key].append(e.end - e.start)
    mean = {k: statistics.mean(v) for k, v in seen.items()}
    return simulate(lists, lambda a: mean[(a.kind, 0 if a.is_encoder else a.stage)]).makespan


def _rank(a):
    ctx = ParallelContext.build(pp=P)
    f, b = a.f_ms / 1e3, a.b_ms / 1e3
    ef = a.share * P * (f + b) / 3
    torch.manual_seed(0)
    stage, encoder = Timed(f, b), Timed(ef, 2 * ef)
    m = a.microbatches
    costs = Costs(F=f, BW=b, EF=ef, EB=2 * ef)
    lists = {pl: place_encoder(build_schedule("1f1b", P, m), pl, costs) for pl in ("stage0", "optimus")}
    for acts in lists.values():
        validate(acts, m)
    images = torch.randn(m, MBS, SEQ, HIDDEN)

    def run(placement):
        enc = EncoderRun(encoder, [[images[i]] for i in range(m)], lambda mb, k: (MBS, SEQ, HIDDEN), ctx)

        def step(c, chunk, x, mb):
            out = chunk(enc.features(mb).transpose(0, 1) if x is None else x)
            return out.sum() if ctx.pp.rank == P - 1 else out

        timeline = []
        dist.barrier()
        run_pipeline(lists[placement][ctx.pp.rank], [stage], ctx, list(range(m)), step, (SEQ, MBS, HIDDEN),
                     torch.float32, timeline=timeline, encoder=enc)
        stage.zero_grad(set_to_none=True)
        encoder.zero_grad(set_to_none=True)
        everyone = [None] * P
        dist.all_gather_object(everyone, timeline)
        return [e for events in everyone for e in events if e.lane == ""]

    for pl in lists:
        run(pl)  # gloo's first messages between two ranks are slow: not timed
    got = {pl: ([], []) for pl in lists}
    for s in range(a.repeats):
        for pl in (["stage0", "optimus"] if s % 2 else ["optimus", "stage0"]):
            tl = run(pl)
            got[pl][0].append(max(e.end for e in tl))
            got[pl][1].append(_predict(lists[pl], tl))
    return {pl: (statistics.median(x), statistics.median(y)) for pl, (x, y) in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    for name, default in (("microbatches", 8), ("repeats", 3), ("f-ms", 20.0), ("b-ms", 40.0), ("share", 0.2)):
        ap.add_argument(f"--{name}", type=type(default), default=default)
    a = ap.parse_args()
    load = os.getloadavg()
    print(f"simulated, p={P}, m={a.microbatches}, unit F/B/W per stage")
    print("| encoder share | schedule | LLM only | stage0 | optimus | optimus / stage0 | bubble LLM only | "
          "bubble optimus | bubble fill |")
    print("|---|---|---|---|---|---|---|---|---|")
    for share, name, llm, s0, op, b0, b1, fill in simulated(a.microbatches):
        print(f"| {share:.2f} | {name} | {llm:.2f} | {s0:.2f} | {op:.2f} | {op / s0:.3f} | {b0:.3f} | {b1:.3f} | "
              f"{fill:.3f} |")
    res = run_ranks(_rank, P, a, timeout=1800)[0]
    print(f"\nmeasured, 1F1B, PP={P}, m={a.microbatches}, fixed cost F {a.f_ms} ms + B {a.b_ms} ms per stage, "
          f"encoder {a.share:.0%} of the LLM; medians of {a.repeats} steps; load average before {load}, "
          f"after {os.getloadavg()}")
    print("| placement | measured (s) | predicted (s) | measured / predicted |")
    print("|---|---|---|---|")
    for pl, (meas, pred) in res.items():
        print(f"| {pl} | {meas:.3f} | {pred:.3f} | {meas / pred:.3f} |")
    print(f"| optimus / stage0 | {res['optimus'][0] / res['stage0'][0]:.3f} | "
          f"{res['optimus'][1] / res['stage0'][1]:.3f} | |")


if __name__ == "__main__":
    main()
