"""ZeRO-1 step time at DP=2: paratron against DeepSpeed ZeRO stage 1, bucket overlap on/off, and
the share of the DP reduction hidden behind backward.

Usage::

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python benchmarks/bench_zero.py [--size small|large] [--steps 30]

Two gloo ranks (forked, one thread each) hold copies of the same tiny GPT (plain PyTorch:
embedding, pre-norm blocks of causal SDPA attention and a GELU MLP, tied output layer; every
param marked with ``paratron.parallel.params.mark``), with the same init; ``--size small`` is
h=128 (667k params), ``large`` h=512:

* ``deepspeed``: DeepSpeed 0.19 ``deepspeed.initialize`` with ZeRO stage 1, fp32,
  ``torch.optim.AdamW`` as the client optimizer (no compiled op), gradient clipping 1.0, at its
  default buckets with ``overlap_comm`` on (as its users run it);
* ``deepspeed_matched``: the same at ``--bucket-mb`` buckets, ``overlap_comm`` off;
* ``paratron``: ``DistributedDataParallel(zero=1)`` + ``build_optimizer``
  (AdamW, clip 1.0), bucket of ``--bucket-mb``, overlap on;
* ``paratron_no_overlap``: the same with overlap off.

One step = ``--microbatches`` forward/backward passes of ``--micro-batch`` samples per rank and
one optimizer step. The copies take their steps in turn, the order reversed every other step
(``pairing.time_paired``); the time of a step is the slower rank's; paired medians with spread
over ``--steps`` after 3 warm-up steps, load average before and after. Then ``--timeline-steps``
more paratron steps are recorded (``paratron.parallel.intervals``): each bucket's reduce-scatter
from issue to completion, and each backward pass; the hidden share is the reduction time during
which a backward ran. The script also checks that the models agree after training (max abs param
difference), so the timings compare runs that compute the same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from paratron.config import OptimizerConfig  # noqa: E402
from paratron.parallel.params import mark  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from pairing import MIN_TIMED_STEPS, add_size_arg, load, summarize, time_paired  # noqa: E402
from paratron.parallel.intervals import hidden_fraction, recording  # noqa: E402


class Block(nn.Module):
    def __init__(self, h: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """tokens [b, s] -> mean token loss (labels [b, s])."""

    def __init__(self, vocab: int, h: int, layers: int, heads: int, seq: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.wte, self.wpe = nn.Embedding(vocab, h), nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        for name, p in self.named_parameters():
            mark(p, name, no_weight_decay=p.dim() == 1)

    def forward(self, tokens, labels):
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data(args, step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    n = args.microbatches * args.micro_batch
    toks = torch.randint(0, args.vocab, (n, args.seq + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def deepspeed_engine(args, kw: dict, cfg: OptimizerConfig, stage: int, fair: bool = False):
    """A fresh ``TinyGPT(**kw)`` wrapped by ``deepspeed.initialize`` at ZeRO ``stage`` (fp32,
    ``torch.optim.AdamW`` as the client optimizer, clipping as ``cfg``). Matched (``fair=False``):
    ``args.bucket_mb`` buckets, ``overlap_comm`` off, stage 3 prefetching one bucket with every
    param partitioned. Fair: DeepSpeed's own defaults for buckets, prefetch and persistence
    (none set), with ``overlap_comm`` on, as its users run it."""
    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel("ERROR")
    model = TinyGPT(**kw)
    decay = [p for p in model.parameters() if p.dim() > 1]
    nodecay = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": nodecay, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    bucket = int(args.bucket_mb * 2**20 / 4)
    zero = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
            "overlap_comm": False, "contiguous_gradients": True}
    if fair:
        zero = {"stage": stage, "overlap_comm": True}
    elif stage == 3:  # prefetch one bucket ahead, as paratron's ZeRO-3 prefetches one unit
        zero.update(stage3_prefetch_bucket_size=bucket, stage3_param_persistence_threshold=0)
    ds_cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.microbatches,
        "train_batch_size": args.micro_batch * args.microbatches * torch.distributed.get_world_size(),
        "gradient_clipping": cfg.clip_grad, "zero_optimization": zero,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg, dist_init_required=False)
    return engine


def deepspeed_step(engine, args, step: int) -> None:
    """One optimizer step of ``engine``: ``args.microbatches`` forward/backward passes (DeepSpeed
    steps the optimizer at the last one)."""
    tokens, labels = _data(args, step, torch.distributed.get_rank())
    mb = args.micro_batch
    for i in range(args.microbatches):
        loss = engine(tokens[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb])
        engine.backward(loss)
        engine.step()


def _rank(args):
    from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads
    from paratron.parallel.context import ParallelContext

    rank = torch.distributed.get_rank()
    dp = torch.distributed.get_world_size()
    kw = dict(vocab=args.vocab, h=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq)
    mb, m = args.micro_batch, args.microbatches
    cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1, clip_grad=1.0)

    # DeepSpeed ZeRO-1: as its users run it (default buckets, overlap_comm) and matched.
    engines = {"deepspeed": deepspeed_engine(args, kw, cfg, stage=1, fair=True),
               "deepspeed_matched": deepspeed_engine(args, kw, cfg, stage=1)}

    # paratron ZeRO-1, overlap on and off.
    ctx = ParallelContext.build()
    runs = {}
    for name, overlap in (("paratron", True), ("paratron_no_overlap", False)):
        model = TinyGPT(**kw)
        ddp = DistributedDataParallel([model], ctx, bucket_size_mb=args.bucket_mb,
                                      overlap_grad_reduce=overlap, zero=1)
        runs[name] = (model, build_optimizer([model], ctx, cfg, ddp))

    def paratron_step(name, step):
        model, opt = runs[name]
        tokens, labels = _data(args, step, rank)
        rec = ctx.ledger.intervals
        opt.zero_grad()
        for i in range(m):
            # The token mean over the global batch (all tokens valid): each microbatch's mean
            # divided by microbatches x DP ranks, then summed by DDP.
            loss = model(tokens[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb])
            with opt.ddp.last_backward() if i == m - 1 else contextlib.nullcontext():
                with rec.compute("backward") if rec is not None else contextlib.nullcontext():
                    (loss / (m * dp)).backward()
        finalize_grads([model], ctx, opt.ddp)
        opt.step()

    def run(name, step):
        return deepspeed_step(engines[name], args, step) if name in engines else paratron_step(name, step)

    times = time_paired(list(engines) + list(runs), args.steps, run)
    ds_params = dict(engines["deepspeed"].module.named_parameters())
    diffs = {}
    for name, (model, _) in runs.items():
        diffs[name] = max((p.detach() - ds_params[n].detach()).abs().max().item()
                          for n, p in model.named_parameters())
    # The timeline: which part of the DP reduction ran while the backward computed.
    hidden = total = 0.0
    with recording(ctx.ledger) as rec:
        for step in range(args.steps, args.steps + args.timeline_steps):
            paratron_step("paratron", step)
            h, t = hidden_fraction(rec.take(), {"bucket_reduce"})
            hidden, total = hidden + h, total + t
    n_params = sum(p.numel() for p in ds_params.values())
    return {"times": times, "max_param_diff_vs_deepspeed": diffs, "params": n_params,
            "reduce_hidden_s": hidden, "reduce_total_s": total}


def parse_args(description: str, layers: int = 2, steps: int = MIN_TIMED_STEPS, extra=None) -> argparse.Namespace:
    """The tiny GPT's size, the batch and the bucket size from the command line (``extra(ap)``
    adds a benchmark's own flags)."""
    ap = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(ap)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    return ap.parse_args()


SIZES = {"small": {"hidden": 128}, "large": {"hidden": 512}}


def main():
    args = parse_args(__doc__.split("\n")[0], extra=lambda ap: (
        add_size_arg(ap), ap.add_argument("--timeline-steps", type=int, default=5)))
    for k, v in SIZES[args.size].items():
        setattr(args, k, v)
    torch.set_num_threads(1)
    before = load()
    out = run_ranks(_rank, 2, args, timeout=3600)[0]
    result = {
        "config": vars(args), "params": out["params"], "load_before": before, "load_after": load(),
        **summarize(out["times"], base="paratron", pairs=[("paratron", "paratron_no_overlap")]),
        "reduce_hidden_behind_backward": round(out["reduce_hidden_s"] / max(out["reduce_total_s"], 1e-12), 3),
        "reduce_ms_per_step": round(out["reduce_total_s"] / args.timeline_steps * 1e3, 2),
        "max_param_diff_vs_deepspeed": out["max_param_diff_vs_deepspeed"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
