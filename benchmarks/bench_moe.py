"""MoE benchmark: step time of a tiny MoE GPT at EP=2 (2 ranks) against EP=1 (1 rank), and the
all-to-all token dispatcher against the all-gather one (both EP=2).

Model: 2 layers, h=128, 4 heads, 8 SwiGLU experts of width 256, top-2, MoE in every layer,
seq 128, vocab 512; global batch 8 samples in microbatches of 2 (fp32, SGD through paratron's DDP
and optimizer). EP=2 runs DP=2 with 4 experts per rank, so each rank does half the tokens of the
EP=1 run: the ideal ratio EP=2 / EP=1 is 0.5. Step = forward + backward of every microbatch of
the rank's share + the optimizer step. Each measurement: 2 warm-up steps, then the median of
``--steps`` steps on the slowest rank; configurations alternate for ``--rounds`` rounds and the
median over rounds is reported, so background load hits all of them alike.

Run: ``.venv/bin/python benchmarks/bench_moe.py [--rounds 3] [--steps 6]``.
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

from paratron.config import Config, validate  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.testing import run_ranks  # noqa: E402

GBS, MBS, SEQ, VOCAB = 8, 2, 128, 512


def _config(ep: int, dispatcher: str, world: int) -> Config:
    cfg = Config()
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


def _step_times(ep: int, dispatcher: str, world: int, steps: int):
    """Runs on every rank: median step seconds and the ledger's bytes per step."""
    from paratron.models.moe.layer import set_aux_loss_scale
    from paratron.training.runner import build_model_and_optimizer

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
    times, nbytes = [], {}
    for step in range(steps + 2):
        record = step == steps + 1
        with ctx.ledger.recording() if record else contextlib.nullcontext():
            t0 = time.perf_counter()
            optimizer.zero_grad()
            for tok, lab in micro:
                (chunk(tok, labels=lab).sum() / (GBS * SEQ)).backward()
            optimizer.step()
            dt = time.perf_counter() - t0
            if record:
                nbytes = {k: v["bytes"] for k, v in ctx.ledger.summary().items() if k.endswith("@ep")}
        if step >= 2:
            times.append(dt)
    return statistics.median(times[:steps]), nbytes


def measure(name: str, ep: int, dispatcher: str, steps: int):
    world = ep
    if world == 1:
        t, nbytes = _step_times(1, dispatcher, 1, steps)
        return t, nbytes
    res = run_ranks(_step_times, world, ep, dispatcher, world, steps, timeout=900)
    return max(r[0] for r in res), res[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    configs = [("ep1", 1, "alltoall"), ("ep2-alltoall", 2, "alltoall"), ("ep2-allgather", 2, "allgather")]
    samples: dict[str, list[float]] = {c[0]: [] for c in configs}
    ledgers = {}
    for r in range(args.rounds):
        for name, ep, disp in configs:
            t, nbytes = measure(name, ep, disp, args.steps)
            samples[name].append(t)
            ledgers[name] = nbytes
            print(f"round {r}: {name}: {t * 1e3:.1f} ms/step  ep-group bytes/step (rank 0): {nbytes}", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: min(v) for k, v in samples.items()}
    print("\n| configuration | ms/step (median of rounds) | ms/step (best round) |")
    print("|---|---|---|")
    for k in med:
        print(f"| {k} | {med[k] * 1e3:.1f} | {best[k] * 1e3:.1f} |")
    for label, d in (("median", med), ("best", best)):
        print(f"\n{label}: EP=2 (2 ranks) / EP=1 (1 rank), all-to-all: "
              f"**{d['ep2-alltoall'] / d['ep1']:.2f}** (ideal 0.5); "
              f"all-to-all / all-gather at EP=2: **{d['ep2-alltoall'] / d['ep2-allgather']:.2f}**")


if __name__ == "__main__":
    main()
