"""MoE benchmark: step time of a tiny MoE GPT at EP=2 (2 ranks) against EP=1 (1 rank), the
all-to-all token dispatcher against the all-gather one and against the chunked, overlapped
all-to-all (``alltoall_chunked``; all at EP=2).

Model: 2 layers, h=128, 4 heads, 8 SwiGLU experts of width 256, top-2, MoE in every layer,
seq 128, vocab 512; global batch 8 samples in microbatches of 2 (fp32, SGD through paratron's DDP
and optimizer). EP=2 runs DP=2 with 4 experts per rank, so each rank does half the tokens of the
EP=1 run: the ideal ratio EP=2 / EP=1 is 0.5. Step = forward + backward of every microbatch of
the rank's share + the optimizer step. Each measurement: 2 warm-up steps, then the median of
``--steps`` steps on the slowest rank; configurations alternate for ``--rounds`` rounds and the
median and best over rounds are reported, so background load hits all of them alike. The CPU time
(``time.process_time``) of the busiest rank is reported too: on a shared machine it tracks the
work per rank better than wall time (it leaves out time spent waiting).

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

Run: ``.venv/bin/python benchmarks/bench_moe.py [--rounds 3] [--steps 6]``;
``.venv/bin/python benchmarks/bench_moe.py --part overlap [--rounds 3] [--steps 4] [--png /tmp/o.png]``;
``.venv/bin/python benchmarks/bench_moe.py --part experts [--rows 4096] [--iters 20]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from paratron.config import Config
from paratron.rules import validate  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

GBS, MBS, SEQ, VOCAB = 8, 2, 128, 512


def _config(ep: int, dispatcher: str, world: int) -> Config:
    """``dispatcher``: a registry name, ``alltoall_chunked:K`` for K token chunks."""
    dispatcher, _, chunks = dispatcher.partition(":")
    cfg = Config()
    if chunks:
        cfg.model.moe_dispatch_chunks = int(chunks)
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, 128, 4
    m.vocab_size, m.seq_length, m.activation, m.add_bias_linear = VOCAB, SEQ, "swiglu", False
    m.normalization, m.position_embedding_type, m.tie_embeddings = "rmsnorm", "rope", False
    m.num_experts, m.moe_top_k, m.moe_ffn_hidden_size = 8, 2, 256
    m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_token_dispatcher = 0.01, 0.001, dispatcher
    p.expert = ep
    t.micro_batch_size, t.global_batch_size = MBS, GBS
    o.name, o.lr, o.weight_decay, o.clip_grad = "sgd", 1e-2, 0.0, 0.0
    return validate(cfg, world)


def _step_times(ep: int, dispatcher: str, world: int, steps: int, intervals: bool = False):
    """Runs on every rank: median step seconds, median CPU seconds, the ledger's EP bytes per step
    and, with ``intervals``, the intervals recorded in ``steps`` more steps (else None)."""
    from paratron.models.moe.layer import set_aux_loss_scale
    from paratron.optim import finalize_grads
    from paratron.parallel.intervals import recording
    from paratron.training.builders import build_model_and_optimizer

    cfg = _config(ep, dispatcher, world)
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
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if args.part == "experts":
        main_experts(args.rows, args.iters)
        return
    if args.part == "overlap":
        main_overlap(args.rounds, args.steps, args.png, args.chunks)
        return
    configs = [("ep1", 1, "alltoall"), ("ep2-alltoall", 2, "alltoall"), ("ep2-allgather", 2, "allgather"),
               ("ep2-chunked", 2, "alltoall_chunked")]
    wall: dict[str, list[float]] = {c[0]: [] for c in configs}
    cpu: dict[str, list[float]] = {c[0]: [] for c in configs}
    for r in range(args.rounds):
        for name, ep, disp in configs:
            t, c, nbytes, _ = measure(ep, disp, args.steps)
            wall[name].append(t)
            cpu[name].append(c)
            print(f"round {r}: {name}: wall {t * 1e3:.1f} ms/step, cpu {c * 1e3:.1f} ms/step, "
                  f"EP-group bytes/step (rank 0): {nbytes}", flush=True)
    rows = {"wall, median of rounds": {k: statistics.median(v) for k, v in wall.items()},
            "wall, best round": {k: min(v) for k, v in wall.items()},
            "CPU of the busiest rank, median": {k: statistics.median(v) for k, v in cpu.items()}}
    print("\n| measure | " + " | ".join(f"{k} (ms)" for k in wall)
          + " | EP=2/EP=1 | all-to-all/all-gather | chunked/all-to-all |")
    print("|---" * (len(wall) + 4) + "|")
    for label, d in rows.items():
        cells = " | ".join(f"{d[k] * 1e3:.1f}" for k in wall)
        print(f"| {label} | {cells} | **{d['ep2-alltoall'] / d['ep1']:.2f}** | "
              f"**{d['ep2-alltoall'] / d['ep2-allgather']:.2f}** | **{d['ep2-chunked'] / d['ep2-alltoall']:.2f}** |")


if __name__ == "__main__":
    main()
