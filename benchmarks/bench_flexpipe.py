"""Token-balanced variable-length microbatches (FlexPipe) against fixed-length padded
microbatches of the same token budget, at PP=2 (1F1B) on the lognormal corpus
(:mod:`paratron.data.lognormal`: median 200, at most 4096 tokens).

Both variants train on the same global batch of documents each step (the document stream of
:class:`~paratron.data.token_batches.TokenBudgetSampler`):

* padded: every document is one row padded to ``--seq`` (the longest document), ``--tokens /
  --seq`` rows per microbatch, plain causal attention (padding sits after the document, so no
  real token sees it; its labels are ignored);
* token-balanced: packed rows of at most ``--tokens`` positions, one attention segment per
  document (``cu_seqlens``), positions restarting per document; the runtime gets each
  microbatch's activation shape (``run_pipeline(tensor_shapes=)``).

Both compute the same loss (checked: the script prints both). Step time: from a barrier to the
end of the slowest rank, the variants taking turns (which goes first alternates); the ratio is the
median over steps of padded / token-balanced in the same step. Padding share of the compute: a
FLOP count, ``6 (L N_layer + V h)`` per position for the linears (the layers and the output
layer) and ``12 h L`` per attended (query, key) pair for attention (forward + backward), over
the positions and causal pairs each variant runs.

Usage::

    .venv/bin/python benchmarks/bench_flexpipe.py [--documents 2000 --global-batch 16 --tokens 4096 \\
        --seq 4096 --layers 4 --hidden 64 --steps 3 --out /tmp/bench_flexpipe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from paratron.config import ModelConfig  # noqa: E402
from paratron.data.indexed import IndexedDataset  # noqa: E402
from paratron.data.lognormal import write_lognormal_dataset  # noqa: E402
from paratron.data.token_batches import (IGNORE_INDEX, DocumentSource, TokenBudgetSampler,  # noqa: E402
                                         collate_pieces)
from paratron.models.gpt import build_model_chunks  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.pipeline.partition import stage_layers  # noqa: E402
from paratron.pipeline.registry import build_schedule  # noqa: E402
from paratron.pipeline.runtime import run_pipeline  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

VOCAB = 512


def padded_microbatches(src: DocumentSource, docs: list[int], seq: int, rows: int) -> list[dict]:
    """Each document one row of ``seq`` positions (padding: token 0, label -100), ``rows`` a microbatch."""
    out = []
    for i in range(0, len(docs), rows):
        toks = torch.zeros(rows, seq, dtype=torch.int64)
        labs = torch.full((rows, seq), IGNORE_INDEX, dtype=torch.int64)
        for r, d in enumerate(docs[i:i + rows]):
            n = int(src.lengths[d])
            window = torch.from_numpy(np.asarray(src.read(d, 0, n), dtype=np.int64))
            toks[r, :n - 1], labs[r, :n - 1] = window[:-1], window[1:]
        out.append({"tokens": toks, "labels": labs})
    return out


def flops(mbs: list[dict], linear_params: int, layers: int, hidden: int) -> tuple[float, float]:
    """(FLOPs, of which on padding) of forward + backward over the microbatches (module docstring)."""
    total = pad = 0.0
    for mb in mbs:
        b, s = mb["tokens"].shape
        cu = mb.get("cu_seqlens")
        segs = (cu[0, 1:] - cu[0, :-1]).tolist() if cu is not None else [s] * b
        real = (mb["labels"] != IGNORE_INDEX).sum(dim=1).tolist()
        lin = 6 * linear_params
        att = 12 * hidden * layers
        total += lin * b * s + att * sum(n * (n + 1) / 2 for n in segs)
        if cu is None:  # padded rows: everything beyond the document's positions is padding
            pad += sum(lin * (s - n) + att * (s * (s + 1) / 2 - n * (n + 1) / 2) for n in real)
    return total, pad


def _rank(a, prefix: str):
    ctx = ParallelContext.build(pp=2)
    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=max(a.hidden // 32, 1),
                      vocab_size=VOCAB, seq_length=a.seq, normalization="rmsnorm", position_embedding_type="rope",
                      activation="swiglu", add_bias_linear=False, tie_embeddings=False)
    chunks = build_model_chunks(cfg, ctx, seed=1, stage_layers=stage_layers(a.layers, 2, 1, None, "1f1b"))
    src = DocumentSource(IndexedDataset(prefix), np.arange(IndexedDataset(prefix).num_documents))
    sampler = TokenBudgetSampler(src.lengths, a.global_batch, a.tokens, a.seq, seed=3)
    layer_params = sum(p.numel() for n, p in chunks[0].named_parameters() if ".layers." in f".{n}")
    linear_params = layer_params // max(1, len(chunks[0].layers)) * a.layers + VOCAB * a.hidden
    times, losses, counts = {"padded": [], "balanced": []}, {"padded": [], "balanced": []}, {}
    for step in range(a.steps + 1):
        docs = sampler.stream(step * a.global_batch, a.global_batch).tolist()
        variants = {"padded": padded_microbatches(src, docs, a.seq, a.tokens // a.seq),
                    "balanced": [collate_pieces(p, src.read) for p in sampler.step(step * a.global_batch)]}
        order = ["padded", "balanced"] if step % 2 else ["balanced", "padded"]
        for name in order:
            mbs = variants[name]
            total = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in mbs)
            shapes = [(mb["tokens"].shape[1], mb["tokens"].shape[0], a.hidden) for mb in mbs]
            seen = []

            def fwd(c, chunk, x, mb):
                packed = {k: mb[k] for k in ("position_ids", "cu_seqlens") if k in mb}
                if not chunk.post_process:
                    return chunk(mb["tokens"] if x is None else x, **packed)
                loss = chunk(mb["tokens"] if x is None else x, labels=mb["labels"], **packed).sum() / total
                seen.append(loss.detach())
                return loss

            actions = build_schedule("1f1b", 2, len(mbs), 1)[ctx.pp.rank]
            dist.barrier()
            t0 = time.perf_counter()
            run_pipeline(actions, chunks, ctx, mbs, fwd, shapes[0], torch.float32, tensor_shapes=shapes)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            loss = torch.tensor([float(sum(seen)) if seen else 0.0])
            dist.all_reduce(loss)
            for c in chunks:
                c.zero_grad(set_to_none=True)
            if step:  # step 0 warms up
                times[name].append(float(elapsed))
                losses[name].append(float(loss))
                counts[name] = counts.get(name, []) + [(len(mbs),) + flops(mbs, linear_params, a.layers, a.hidden)]
    return {"times": times, "losses": losses, "counts": counts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--documents", type=int, default=2000)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/bench_flexpipe.json")
    a = ap.parse_args()
    prefix = "/tmp/bench_flexpipe_lognormal"
    write_lognormal_dataset(prefix, a.documents, VOCAB, eod=0, seed=0)
    load0 = os.getloadavg()
    res = run_ranks(_rank, 2, a, prefix, timeout=3600)[0]
    load1 = os.getloadavg()
    t, c = res["times"], res["counts"]
    ratios = [p / b for p, b in zip(t["padded"], t["balanced"])]
    print(f"load average before/after: {load0[0]:.1f} / {load1[0]:.1f}")
    print(f"{'':28}{'padded':>12}{'balanced':>12}")
    for name, key in (("median step time (s)", "times"),):
        print(f"{name:28}{statistics.median(t['padded']):12.3f}{statistics.median(t['balanced']):12.3f}")
    print(f"{'microbatches per step':28}{statistics.mean(x[0] for x in c['padded']):12.1f}"
          f"{statistics.mean(x[0] for x in c['balanced']):12.1f}")
    tp, pp_ = sum(x[1] for x in c["padded"]), sum(x[2] for x in c["padded"])
    tb = sum(x[1] for x in c["balanced"])
    print(f"{'GFLOP per step':28}{tp / len(c['padded']) / 1e9:12.1f}{tb / len(c['balanced']) / 1e9:12.1f}")
    print(f"{'padding share of FLOPs':28}{pp_ / tp:12.3f}{0.0:12.3f}")
    print(f"{'loss (sum of steps)':28}{sum(res['losses']['padded']):12.6f}{sum(res['losses']['balanced']):12.6f}")
    print(f"step time ratio padded / balanced (median of {len(ratios)}): {statistics.median(ratios):.2f}")
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "load": [load0[0], load1[0]], **res, "ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
