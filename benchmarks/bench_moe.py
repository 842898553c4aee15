"""MoE benchmark: step time of a tiny MoE GPT at EP=2 against EP=1 on the same 2 ranks, the
all-to-all token dispatcher against the all-gather one and against the chunked, overlapped
all-to-all (``alltoall_chunked``).

Model (``--size small``, the default and the size of every earlier table): 2 layers, h=128, 4
heads, 8 SwiGLU experts of width 256, top-2, MoE in every layer, seq 128, vocab 512; global batch
8 samples in microbatches of 2 (fp32, SGD through paratron's DDP and optimizer). ``--size large``:
h=512, experts of width 1024 (16x the params). Part ``steps`` (the default): four models on the
same 2 gloo ranks, ``ep1-dp2`` (EP=1, DP=2: 8 experts per rank, no EP all-to-all),
``ep2-alltoall``, ``ep2-allgather`` and ``ep2-chunked`` (EP=2, DP=2: 4 experts per rank); every
rank does the same tokens in each, so the ideal EP=2 / EP=1 ratio is 1.0 (the cost of expert
parallelism's communication). Step = forward + backward of every microbatch of the rank's share +
the optimizer step, timed with ``pairing.time_paired`` (order reversed every other step, 2
warm-up, ``--steps`` >= 30, the slower rank's time); printed as JSON: median ms and paired ratios
(median of per-step ratios, interquartile range, min-max) against ``ep1-dp2`` and of all-to-all
/ all-gather and chunked / all-to-all, the EP-group bytes of one step, load before and after.

Part ``experts`` (``--part experts``): the expert compute alone (forward + backward of
:class:`~paratron.models.moe.experts.LocalExperts`, SwiGLU h=128, f=256, ``--rows`` expert-major
rows spread over the experts at random) as grouped GEMMs (``gemm="grouped_mm"``, i.e.
``torch._grouped_mm``, and ``gemm="bmm"``) against the per-expert loop (each
``ExpertMLP`` on its own rows, the code before grouped GEMMs), with 8 and 32 local experts, one
process. The variants alternate within each iteration; the median over ``--iters`` is reported.

Part ``overlap`` (``--part overlap``): the plain against the chunked all-to-all at EP=2 with
``--chunks`` k token chunks (default 2 and 4), same model: step time (as above), and the share of the EP all-to-all time (dispatch and combine,
forward and backward) hidden behind expert compute, measured from the intervals recorded in
``--steps`` more steps (:mod:`paratron.parallel.intervals`: each all-to-all from issue to
completion, each expert forward / backward; ``hidden_fraction``), against FarSkip-Collective's
reported 88.4 %. ``--png`` draws the last recorded step.

Run: ``.venv/bin/python benchmarks/bench_moe.py [--size small|large] [--steps 30]``;
``.venv/bin/python benchmarks/bench_moe.py --part overlap [--rounds 3] [--steps 4] [--png /tmp/o.png]``;
``.venv/bin/python benchmarks/bench_moe.py --part experts [--rows 4096] [--iters 20]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from paratron.config import Config
from paratron.rules import validate  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402
from pairing import MIN_TIMED_STEPS, add_size_arg, load, summarize, time_paired  # noqa: E402

GBS, MBS, SEQ, VOCAB = 8, 2, 128, 512
SIZES = {"small": (128, 256), "large": (512, 1024)}  # (hidden, expert width): 16x the params
STEP_VARIANTS = (("ep1-dp2", 1, "alltoall"), ("ep2-alltoall", 2, "alltoall"), ("ep2-allgather", 2, "allgather"),
                 ("ep2-chunked", 2, "alltoall_chunked"))


def _config(ep: int, dispatcher: str, world: int, size: str = "small") -> Config:
    """``dispatcher``: a registry name, ``alltoall_chunked:K`` for K token chunks."""
    dispatcher, _, chunks = dispatcher.partition(":")
    cfg = Config()
    if chunks:
        cfg.model.moe_dispatch_chunks = int(chunks)
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    m.num_layers, m.num_attention_heads = 2, 4
    m.hidden_size, m.moe_ffn_hidden_size = SIZES[size]
    m.vocab_size, m.seq_length, m.activation, m.add_bias_linear = VOCAB, SEQ, "swiglu", False
    m.normalization, m.position_embedding_type, m.tie_embeddings = "rmsnorm", "rope", False
    m.num_experts, m.moe_top_k = 8, 2
    m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_token_dispatcher = 0.01, 0.001, dispatcher
    p.expert = ep
    t.micro_batch_size, t.global_batch_size = MBS, GBS
    o.name, o.lr, o.weight_decay, o.clip_grad = "sgd", 1e-2, 0.0, 0.0
    return validate(cfg, world)


def _one_step(ep: int, dispatcher: str, world: int, size: str = "small"):
    """This rank's model at ``ep`` and a function that runs one training step: (ctx, step)."""
    from paratron.models.moe.layer import set_aux_loss_scale
    from paratron.optim import finalize_grads
    from paratron.training.builders import build_model_and_optimizer

    cfg = _config(ep, dispatcher, world, size)
    ctx = ParallelContext.build(ep=ep) if world > 1 else ParallelContext.single()
    chunks, _, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    (chunk,) = chunks
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (GBS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (GBS, SEQ), generator=g)
    rows = GBS // ctx.dp.size
    mine = slice(ctx.dp.rank * rows, (ctx.dp.rank + 1) * rows)
    micro = [(tokens[mine][i:i + MBS], labels[mine][i:i + MBS]) for i in range(0, rows, MBS)]
    set_aux_loss_scale(chunk, 1.0 / (len(micro) * ctx.dp.size))

    def one_step():
        optimizer.zero_grad()
        for tok, lab in micro:
            (chunk(tok, labels=lab).sum() / (GBS * SEQ)).backward()
        finalize_grads(chunks, ctx, optimizer.ddp)
        optimizer.step()

    return ctx, one_step


def _ep_bytes(ctx, one_step) -> dict:
    """The ledger's EP-group bytes of one step on this rank."""
    with ctx.ledger.recording():
        one_step()
        return {k: v["bytes"] for k, v in ctx.ledger.summary().items() if k.endswith("@ep")}


def _step_times(ep: int, dispatcher: str, world: int, steps: int, intervals: bool = False):
    """Runs on every rank: median step seconds, median CPU seconds, the ledger's EP bytes per step
    and, with ``intervals``, the intervals recorded in ``steps`` more steps (else None)."""
    from paratron.parallel.intervals import recording

    ctx, one_step = _one_step(ep, dispatcher, world)
    times, cpu, nbytes = [], [], {}
    for step in range(steps + 2):
        record = step == steps + 1
        with ctx.ledger.recording() if record else contextlib.nullcontext():
            t0, c0 = time.perf_counter(), time.process_time()
            one_step()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if record:
                nbytes = {k: v["bytes"] for k, v in ctx.ledger.summary().items() if k.endswith("@ep")}
        if 2 <= step < steps + 2:
            times.append(dt)
            cpu.append(dc)
    recorded = None
    if intervals:  # separate steps: the recorder's callbacks and marks stay out of the timings
        with recording(ctx.ledger) as rec:
            for _ in range(steps):
                one_step()
        recorded = rec.take()
    return statistics.median(times), statistics.median(cpu), nbytes, recorded


def measure(ep: int, dispatcher: str, steps: int, intervals: bool = False):
    """(wall s/step of the slowest rank, CPU s/step of the busiest rank, rank 0's EP-group bytes,
    the recorded intervals of each rank or None)."""
    if ep == 1:
        t, c, nbytes, rec = _step_times(1, dispatcher, 1, steps, intervals)
        return t, c, nbytes, [rec]
    res = run_ranks(_step_times, ep, ep, dispatcher, ep, steps, intervals, timeout=900)
    return max(r[0] for r in res), max(r[1] for r in res), res[0][2], [r[3] for r in res]


def _expert_times(num_local: int, rows: int, iters: int) -> dict[str, float]:
    """Median fwd+bwd seconds of each expert-compute variant on the same rows."""
    from paratron.models.moe.experts import LocalExperts

    cfg = _config(1, "alltoall", 1).model
    cfg.num_experts = num_local
    experts = LocalExperts(cfg, ParallelContext.single(), prefix="layers.0.mlp", seed=0, first_expert=0,
                           num_local=num_local, params_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.randint(0, num_local, (rows,), generator=g), minlength=num_local).tolist()
    x = torch.randn(rows, cfg.hidden_size, generator=g).requires_grad_()

    def per_expert_loop():
        return torch.cat([e(part) for e, part in zip(experts.local, torch.split(x, counts))])

    def grouped():
        return experts(x, counts)

    variants = {"loop": per_expert_loop, "grouped_mm": grouped, "bmm": grouped}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for it in range(iters + 2):
        for name, fn in variants.items():
            experts.gemm = name
            t0 = time.perf_counter()
            fn().sum().backward()
            if it >= 2:
                times[name].append(time.perf_counter() - t0)
            experts.zero_grad(set_to_none=True)
            x.grad = None
    return {k: statistics.median(v) for k, v in times.items()}


def main_experts(rows: int, iters: int) -> None:
    print(f"load average: {os.getloadavg()}")
    print("\n| local experts | rows | per-expert loop (ms) | grouped_mm (ms) | padded bmm (ms) "
          "| grouped/loop | bmm/loop |\n|---|---|---|---|---|---|---|")
    for num_local in (8, 32):
        t = _expert_times(num_local, rows, iters)
        print(f"| {num_local} | {rows} | {t['loop'] * 1e3:.2f} | {t['grouped_mm'] * 1e3:.2f} | {t['bmm'] * 1e3:.2f} "
              f"| **{t['grouped_mm'] / t['loop']:.2f}** | **{t['bmm'] / t['loop']:.2f}** |", flush=True)
    print(f"load average: {os.getloadavg()}")


FORWARD, BACKWARD = ("dispatch", "combine"), ("dispatch_grad", "combine_grad")
FARSKIP_OVERLAP = 0.884  # FarSkip-Collective (MLSys'26): share of EP communication overlapped


def _hidden(per_rank, kinds) -> tuple[float, float]:
    """(hidden, total) all-to-all seconds of ``kinds``, summed over the ranks' recorded steps."""
    from paratron.parallel.intervals import hidden_fraction

    pairs = [hidden_fraction(ivs, kinds) for ivs in per_rank]
    return sum(h for h, _ in pairs), sum(t for _, t in pairs)


def _draw_overlap(per_rank, steps: int, path: str) -> None:
    """The last recorded step's intervals of each rank (compute and comm lanes) as a PNG."""
    from paratron.pipeline.timeline import draw_png, from_intervals

    per_rank = [ivs[-len(ivs) // steps:] for ivs in per_rank]  # about the last step
    t0 = min(iv.start for ivs in per_rank for iv in ivs)
    events = [e for r, ivs in enumerate(per_rank) for e in from_intervals(ivs, r, t0)]
    events = [e for e in events if e.kind in FORWARD + BACKWARD + ("experts", "experts_grad")]
    print(f"wrote {draw_png(events, path, title='alltoall_chunked, EP=2, about one step', unit='s')}")


def main_overlap(rounds: int, steps: int, png: str | None, chunks: list[int]) -> None:
    """Plain against chunked all-to-all at EP=2: step time, and the share of the EP all-to-all
    time hidden behind expert compute (from the intervals recorded in ``steps`` extra steps)."""
    print(f"load average: {os.getloadavg()}")
    names = ("alltoall",) + tuple(f"alltoall_chunked:{k}" for k in chunks)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    hidden = {n: {"fwd": [0.0, 0.0], "bwd": [0.0, 0.0]} for n in names}
    last = None
    for r in range(rounds):
        for n in names[::-1] if r % 2 else names:  # alternate which one goes first
            t, c, _, recorded = measure(2, n, steps, intervals=True)
            wall[n].append(t)
            cpu[n].append(c)
            for part, kinds in (("fwd", FORWARD), ("bwd", BACKWARD)):
                h, tot = _hidden(recorded, kinds)
                hidden[n][part][0] += h
                hidden[n][part][1] += tot
            last = recorded if n == names[1] else last
            print(f"round {r}: {n}: wall {t * 1e3:.1f} ms/step, cpu {c * 1e3:.1f} ms/step, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    print("\n| dispatcher | wall, median (ms) | wall, best (ms) | CPU busiest rank (ms) | all-to-all (ms/step/rank) "
          "| hidden, forward | hidden, backward | hidden, all |\n|---|---|---|---|---|---|---|---|")
    for n in names:
        hf, hb = hidden[n]["fwd"], hidden[n]["bwd"]
        a2a = (hf[1] + hb[1]) / (2 * rounds * steps)
        share = (hf[0] + hb[0]) / max(hf[1] + hb[1], 1e-12)
        print(f"| {n} | {statistics.median(wall[n]) * 1e3:.1f} | {min(wall[n]) * 1e3:.1f} | "
              f"{statistics.median(cpu[n]) * 1e3:.1f} | {a2a * 1e3:.2f} | {hf[0] / max(hf[1], 1e-12):.1%} | "
              f"{hb[0] / max(hb[1], 1e-12):.1%} | **{share:.1%}** |")
    for n in names[1:]:
        print(f"{n}/plain: wall median {statistics.median(wall[n]) / statistics.median(wall['alltoall']):.2f}, "
              f"best {min(wall[n]) / min(wall['alltoall']):.2f}; CPU "
              f"{statistics.median(cpu[n]) / statistics.median(cpu['alltoall']):.2f}")
    print(f"FarSkip-Collective reports {FARSKIP_OVERLAP:.1%} overlap.")
    print(f"load average: {os.getloadavg()}")
    if png:
        _draw_overlap(last, steps, png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["steps", "experts", "overlap"], default="steps")
    ap.add_argument("--png", default=None, help="--part overlap: draw the first chunked run's recorded step here")
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 4], help="--part overlap: chunk counts k")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None,
                    help=f"timed steps (default {MIN_TIMED_STEPS} for --part steps, 6 for overlap)")
    add_size_arg(ap)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    args.steps = args.steps or (MIN_TIMED_STEPS if args.part == "steps" else None)
    if args.part == "experts":
        main_experts(args.rows, args.iters)
        return
    if args.part == "overlap":
        main_overlap(args.rounds, args.steps or 6, args.png, args.chunks)
        return
    before = load()
    res = run_ranks(_paired_steps, 2, args.size, args.steps, timeout=3000)[0]
    print(json.dumps({"config": vars(args), "load_before": before, "load_after": load(),
                      "ep_bytes_per_step_rank0": res["bytes"],
                      **summarize(res["times"], pairs=[("ep2-alltoall", "ep2-allgather"),
                                                       ("ep2-chunked", "ep2-alltoall")])}, indent=1))


def _paired_steps(size: str, steps: int) -> dict:
    """Every ``STEP_VARIANTS`` model on the same 2 ranks (EP=1 is DP=2 without expert
    parallelism: the same tokens per rank, no EP all-to-all), steps taken in turn."""
    runs = {name: _one_step(ep, disp, 2, size) for name, ep, disp in STEP_VARIANTS}
    nbytes = {name: _ep_bytes(*run) for name, run in runs.items()}
    times = time_paired(list(runs), steps, lambda name, _i: runs[name][1](), warmup=2)
    return {"times": times, "bytes": nbytes}


if __name__ == "__main__":
    main()
