"""Pipeline benchmark: paratron's runtime against ``torch.distributed.pipelining`` on the same
model and schedule (1F1B, interleaved 1F1B), and paratron's measured step time against the
simulator's prediction from measured per-action costs.

The model is a GPT built from paratron's layers (untied embeddings, fp32), split over 4 pipeline
ranks (gloo, one thread each, forked by ``paratron.local_ranks.run_ranks``). Both frameworks run the
same ``GPTChunk`` modules and the same vocab-parallel cross-entropy; torch's schedules get
``scale_grads=False`` because the loss is already divided by the global token count, like ours.
Step time: from a barrier to the end of the slowest rank's schedule (``pairing.time_paired``: the
two frameworks take turns, which one goes first reversed every other step, ``--steps`` >= 30 timed
after ``--warmup``); the ratio is the paired median of paratron's time / torch's time in the same
step, with its interquartile range, and the load average before and after.

Sizes (``--size``): ``small`` (the default, the size every earlier table used) is 8 layers, h=128,
s=128, microbatch 4 (1.6M params in the layers); ``large`` is 8 layers at h=512 (25.2M, 16x),
s=128, microbatch 1 so that a step still fits a loaded 2-core machine. Flags override.

Prediction: the mean F and BW duration of every stage, measured by paratron's recorded timeline
in the same steps, and a p2p latency from a ping-pong of one activation, are fed to
``paratron.pipeline.simulator.simulate`` for the very action lists that ran.

Usage::

    .venv/bin/python benchmarks/bench_pipeline.py [--size small|large] [--ranks 4 --microbatches 8 \\
        --steps 30 --out benchmarks]
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

torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from paratron.config import ModelConfig  # noqa: E402
from paratron.layers import vocab_parallel_cross_entropy  # noqa: E402
from paratron.models.gpt import build_model_chunks  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.pipeline.partition import stage_layers  # noqa: E402
from paratron.pipeline.registry import build_schedule  # noqa: E402
from paratron.pipeline.runtime import run_pipeline  # noqa: E402
from paratron.pipeline.simulator import simulate  # noqa: E402
from paratron.pipeline.timeline import TraceEvent, draw_png, from_spans  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402
from pairing import MIN_TIMED_STEPS, add_size_arg, fmt_ratio, load, paired_ratio, time_paired  # noqa: E402

VOCAB = 512
SIZES = {"small": {"layers": 8, "hidden": 128, "seq": 128, "mbs": 4},
         "large": {"layers": 8, "hidden": 512, "seq": 128, "mbs": 1}}


def _cfg(a) -> ModelConfig:
    return ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=max(a.hidden // 64, 1),
                       vocab_size=VOCAB, seq_length=a.seq, tie_embeddings=False, add_bias_linear=True)


def _batch(a, step):
    g = torch.Generator().manual_seed(step)
    n = a.mbs * a.microbatches
    return torch.randint(0, VOCAB, (n, a.seq), generator=g), torch.randint(0, VOCAB, (n, a.seq), generator=g)


class _TorchStage(torch.nn.Module):
    """torch.distributed.pipelining wants ``forward(x) -> y``; the last stage returns logits."""

    def __init__(self, chunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x):
        return self.chunk(x)


def _latency(ctx, shape, rounds=20):
    """Half the round-trip time of one activation between pipeline ranks 0 and 1."""
    t = torch.zeros(shape)
    r = ctx.pp.rank
    start = time.perf_counter()
    for _ in range(rounds):
        if r == 0:
            for w in dist.batch_isend_irecv([ctx.pp.p2p_op("send", t, 1)]):
                w.wait()
            for w in dist.batch_isend_irecv([ctx.pp.p2p_op("recv", t, 1)]):
                w.wait()
        elif r == 1:
            for w in dist.batch_isend_irecv([ctx.pp.p2p_op("recv", t, 0)]):
                w.wait()
            for w in dist.batch_isend_irecv([ctx.pp.p2p_op("send", t, 0)]):
                w.wait()
    out = torch.tensor([(time.perf_counter() - start) / (2 * rounds) if r == 0 else 0.0], dtype=torch.float64)
    ctx.world.all_reduce(out)
    return out.item()


def _rank(a, schedule, v):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    p = dist.get_world_size()
    ctx = ParallelContext.build(pp=p)
    cfg = _cfg(a)
    layers = stage_layers(cfg.num_layers, p, v, None, schedule)
    ours = build_model_chunks(cfg, ctx, seed=1, stage_layers=layers)
    theirs = build_model_chunks(cfg, ctx, seed=1, stage_layers=layers)
    stages = [c * p + ctx.pp.rank for c in range(v)]
    actions = build_schedule(schedule, p, a.microbatches, v)[ctx.pp.rank]
    shape = (a.seq, a.mbs, a.hidden)

    def loss_fn(logits, labels):
        return vocab_parallel_cross_entropy(logits, labels.t().contiguous(), ctx, VOCAB).sum() / labels.numel()

    pipe_stages = [PipelineStage(_TorchStage(ch), s, p * v, torch.device("cpu"), group=ctx.pp.pg)
                   for ch, s in zip(theirs, stages)]
    if v == 1:
        torch_sched = Schedule1F1B(pipe_stages[0], a.microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        torch_sched = ScheduleInterleaved1F1B(pipe_stages, a.microbatches, loss_fn=loss_fn, scale_grads=False)

    def ours_step(step, timeline):
        ids, labels = _batch(a, step)
        total = labels.numel()
        micro = [(ids[i * a.mbs:(i + 1) * a.mbs], labels[i * a.mbs:(i + 1) * a.mbs]) for i in range(a.microbatches)]

        def fwd(c, chunk, x, mb):
            out = chunk(mb[0] if x is None else x, mb[1] if chunk.post_process else None)
            return out.sum() / total if chunk.post_process else out

        run_pipeline(actions, ours, ctx, micro, fwd, shape, torch.float32, timeline=timeline)

    def torch_step(step):
        ids, labels = _batch(a, step)
        if ctx.is_first_stage:
            torch_sched.step(ids, target=labels if ctx.is_last_stage else None)
        elif ctx.is_last_stage:
            torch_sched.step(target=labels)
        else:
            torch_sched.step()

    events: list[TraceEvent] = []
    costs = defaultdict(list)

    def run(name, step):
        for chunk in ours if name == "paratron" else theirs:
            chunk.zero_grad(set_to_none=True)
        if name == "torch":
            return torch_step(step)
        timeline = [] if step >= a.warmup else None
        ours_step(step, timeline)
        if timeline:
            events[:] = timeline  # the last timed step's timeline is drawn
            for e in timeline:
                costs[(e.kind, e.stage)].append(e.end - e.start)

    times = time_paired(["paratron", "torch"], a.steps, run, warmup=a.warmup)
    times.update(costs)
    latency = _latency(ctx, shape)
    return dict(times), events, latency


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    add_size_arg(ap)
    for flag in ("--layers", "--hidden", "--seq", "--mbs"):
        ap.add_argument(flag, type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=MIN_TIMED_STEPS)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    a = ap.parse_args()
    for k, v in SIZES[a.size].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    p = a.ranks
    print(f"load before: {load()}")
    print(f"model: {a.layers} layers, h={a.hidden}, s={a.seq}, microbatch {a.mbs}, m={a.microbatches}, "
          f"{p} ranks x 1 thread, {os.cpu_count()} cores")
    print("| schedule | paratron step (s) | torch step (s) | paratron / torch, paired [IQR] | predicted (s) "
          "| measured / predicted |")
    print("|---|---|---|---|---|---|")
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        results = run_ranks(_rank, p, a, schedule, v, timeout=1800)
        times, latency = results[0][0], results[0][2]
        events = [e for r in results for e in r[1]]
        costs = defaultdict(list)
        for r in results:
            for key, vals in r[0].items():
                if isinstance(key, tuple):
                    costs[key].extend(vals)
        mean = {k: statistics.mean(vs) for k, vs in costs.items()}
        lists = build_schedule(schedule, p, a.microbatches, v)
        sim = simulate(lists, lambda act: mean[(act.kind, act.stage)], latency=latency)
        ours, theirs = statistics.median(times["paratron"]), statistics.median(times["torch"])
        # Steps run in pairs under the same machine load: the median of the per-pair ratios is
        # steadier than the ratio of the medians on a shared machine.
        ratio = paired_ratio(times["paratron"], times["torch"])
        print(f"| {schedule} | {ours:.3f} | {theirs:.3f} | **{fmt_ratio(ratio)}** (min-max {ratio['min']:.2f}-"
              f"{ratio['max']:.2f}) | {sim.makespan:.3f} | "
              f"**{ours / sim.makespan:.2f}** |")
        sys.stdout.flush()
        title = f"{schedule}, {p} ranks, m={a.microbatches}, v={v}"
        draw_png(events, os.path.join(a.out, f"pipeline_{schedule}_measured.png"), title=f"measured: {title}",
                 unit="s")
        draw_png(from_spans(sim.spans), os.path.join(a.out, f"pipeline_{schedule}_simulated.png"),
                 title=f"simulated from measured costs: {title}", unit="s")
        print(f"  p2p latency {latency * 1e3:.3f} ms; mean F/BW per stage (ms): " + ", ".join(
            f"s{s}: {mean[('F', s)] * 1e3:.1f}/{mean[('BW', s)] * 1e3:.1f}" for s in range(p * v)))
    print(f"load after: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
