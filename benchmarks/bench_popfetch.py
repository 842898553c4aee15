"""PopFetcher (USENIX ATC'25) push/pull expert prefetch (``model.moe_token_dispatcher = "prefetch"``)
against the all-to-all dispatcher at EP=2 (2 gloo ranks), on a skewed router.

Model: ``bench_moe.py``'s (2 layers, h=128, 4 heads, 8 SwiGLU experts of width 256, i.e.
P = 98,304 params per expert, top-2, MoE in every layer, seq 128, vocab 512), fp32, global
batch ``--gbs`` samples in microbatches of ``--mbs`` (default 16 / 8: one microbatch of 1,024
tokens per rank, 2,048 (token, slot) pairs). Skew: every router's expert bias (DeepSeek-V3's
selection-only bias, ``moe_router_enable_expert_bias``, update rate 0) is +10 on the ``--hot``
first experts (default 1: expert 0, held by EP rank 0), so every token's first choice is a hot
expert, as in PopFetcher's popular experts; the second choice follows the scores. At 1,024 pairs
per rank for expert 0, rank 1's rule pulls it (1,024 * 128 > 98,304) once its routing window
has seen one step.

Per dispatcher: the step time (forward + backward of the rank's microbatches + DDP finalize +
SGD step; median of ``--steps`` steps after 2 warm-up steps, slowest rank's wall and busiest
rank's CPU), the EP-group bytes of one step from the comm ledger (summed over both ranks,
forward + backward), and the share of (token, slot) pairs computed on their own rank. For the
prefetch dispatcher, ``--steps`` further steps record intervals (:mod:`paratron.parallel.intervals`,
the attention wrapped as compute): the share of the weight fetch's flight time (issue to
completion; forward ``prefetch``, backward ``prefetch_grad``) during which compute ran. The two
dispatchers alternate for ``--rounds`` rounds (each builds the model afresh); the median over
rounds is reported with the load average before and after.

Run: ``.venv/bin/python benchmarks/bench_popfetch.py [--rounds 3] [--steps 4] [--hot 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_moe import SEQ, VOCAB, _config  # noqa: E402
from paratron.rules import validate  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

EP = 2
DISPATCHERS = ("alltoall", "prefetch")


def _skew_routers(chunk, hot: int) -> tuple[list, list]:
    """Bias every router's selection to the first ``hot`` experts. Returns two records filled by
    forward hooks: each MoE forward's routing ``indices [T, k]``, and its pairs run on pulled
    experts (prefetch only)."""
    from paratron.models.moe.layer import moe_layers

    routed, pulled = [], []
    for m in moe_layers(chunk):
        with torch.no_grad():
            m.router.expert_bias.zero_()[:hot] = 10.0
        m.router.register_forward_hook(lambda _mod, _inp, out: routed.append(out.indices.detach()))
        if m.dispatcher_state is not None:
            m.register_forward_hook(lambda mod, _inp, _out: pulled.append(mod.dispatcher_state.last_stats["pulled"]))
    return routed, pulled


def _run(dispatcher: str, gbs: int, mbs: int, steps: int, hot: int):
    """On every rank: (median wall s, median CPU s, EP bytes of one step, own-rank pair share)."""
    from paratron.models.moe.layer import set_aux_loss_scale
    from paratron.optim import finalize_grads
    from paratron.training.builders import build_model_and_optimizer

    cfg = _config(EP, dispatcher, EP)
    cfg.model.moe_router_enable_expert_bias, cfg.model.moe_router_bias_update_rate = True, 0.0
    cfg.train.global_batch_size, cfg.train.micro_batch_size = gbs, mbs
    validate(cfg, EP)
    ctx = ParallelContext.build(ep=EP)
    chunks, _, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    (chunk,) = chunks
    routed, pulled = _skew_routers(chunk, hot)
    g = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, VOCAB, (gbs, SEQ), generator=g) for _ in range(2))
    rows = gbs // ctx.dp.size
    mine = slice(ctx.dp.rank * rows, (ctx.dp.rank + 1) * rows)
    micro = [(tokens[mine][i:i + mbs], labels[mine][i:i + mbs]) for i in range(0, rows, mbs)]
    set_aux_loss_scale(chunk, 1.0 / (len(micro) * ctx.dp.size))

    def one_step():
        optimizer.zero_grad()
        for tok, lab in micro:
            (chunk(tok, labels=lab).sum() / (gbs * SEQ)).backward()
        finalize_grads(chunks, ctx, optimizer.ddp)
        optimizer.step()

    wall, cpu = [], []
    for step in range(steps + 2):
        t0, c0 = time.perf_counter(), time.process_time()
        one_step()
        if step >= 2:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    routed.clear()
    pulled.clear()
    with ctx.ledger.recording():
        one_step()
        nbytes = ctx.ledger.total(group="ep").bytes
    num_local = cfg.model.num_experts // EP
    pairs = sum(int((ix >= 0).sum()) for ix in routed)
    own = sum(int(((ix >= 0) & (ix // num_local == ctx.ep.rank)).sum()) for ix in routed)
    share = (own + sum(pulled)) / pairs  # before the extra steps below add to the records
    hidden = _fetch_hidden(chunk, ctx, one_step, steps) if dispatcher == "prefetch" else (0.0, 0.0, 0.0, 0.0)
    return statistics.median(wall), statistics.median(cpu), nbytes, share, hidden


def _fetch_hidden(chunk, ctx, one_step, steps: int) -> tuple[float, float, float, float]:
    """In ``steps`` extra steps with the attention recorded as compute: (hidden, total) seconds
    of the weight fetch's flights, forward (``prefetch``) and backward (``prefetch_grad``)."""
    from paratron.parallel.intervals import hidden_fraction, recording, timed

    for layer in chunk.layers.values():
        forward = layer.attention.forward
        layer.attention.forward = lambda x, *a, _f=forward: timed(ctx.ledger, "attention", _f, x, *a)
    with recording(ctx.ledger) as rec:
        for _ in range(steps):
            one_step()
    ivs = rec.take()
    return hidden_fraction(ivs, ("prefetch",)) + hidden_fraction(ivs, ("prefetch_grad",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--hot", type=int, default=1)
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}", flush=True)
    res, hid = {d: [] for d in DISPATCHERS}, []
    for r in range(args.rounds):
        for d in (DISPATCHERS if r % 2 == 0 else DISPATCHERS[::-1]):
            per_rank = run_ranks(_run, EP, d, args.gbs, args.mbs, args.steps, args.hot, timeout=900)
            res[d].append((max(x[0] for x in per_rank), max(x[1] for x in per_rank),
                           sum(x[2] for x in per_rank), sum(x[3] for x in per_rank) / EP))
            if d == "prefetch":
                hid.append([sum(x[4][i] for x in per_rank) for i in range(4)])
            print(f"round {r} {d}: wall {res[d][-1][0] * 1e3:.1f} ms, CPU {res[d][-1][1] * 1e3:.1f} ms, "
                  f"EP bytes {res[d][-1][2]}, own-rank pairs {res[d][-1][3]:.3f}", flush=True)
    med = {d: [statistics.median(x[i] for x in res[d]) for i in range(4)] for d in DISPATCHERS}
    a, p = med["alltoall"], med["prefetch"]
    print("\n| dispatcher | wall (ms) | CPU (ms) | EP bytes / step | pairs on own rank |\n|---|---|---|---|---|")
    for d in DISPATCHERS:
        w, c, b, s = med[d]
        print(f"| {d} | {w * 1e3:.1f} | {c * 1e3:.1f} | {b / 1e6:.2f} MB | {s:.3f} |")
    print(f"| prefetch / alltoall | **{p[0] / a[0]:.2f}** | **{p[1] / a[1]:.2f}** | **{p[2] / a[2]:.3f}** | |")
    h = [sum(x[i] for x in hid) for i in range(4)]
    print(f"\nweight fetch hidden behind compute (attention, summed over ranks and rounds): forward "
          f"{h[0] / max(h[1], 1e-12):.2f} of {h[1] * 1e3:.1f} ms, backward {h[2] / max(h[3], 1e-12):.2f} "
          f"of {h[3] * 1e3:.1f} ms")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
