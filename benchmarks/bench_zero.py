"""ZeRO-1 step time at DP=2: paratron against DeepSpeed ZeRO stage 1, and bucket overlap on/off.

Usage::

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 .venv/bin/python benchmarks/bench_zero.py [--steps 10]

Two gloo ranks (forked, one thread each) hold three copies of the same tiny GPT (plain PyTorch:
embedding, pre-norm blocks of causal SDPA attention and a GELU MLP, tied output layer; every
param marked with ``paratron.parallel.params.mark``), with the same init:

* DeepSpeed 0.19 ``deepspeed.initialize`` with ZeRO stage 1, fp32, ``torch.optim.AdamW`` as the
  client optimizer (no compiled op), gradient clipping 1.0, reduce bucket of ``--bucket-mb``;
* paratron ``DistributedDataParallel(zero=1)`` + ``build_optimizer``
  (AdamW, clip 1.0), bucket of ``--bucket-mb``, overlap on;
* the same with overlap off.

One step = ``--microbatches`` forward/backward passes of ``--micro-batch`` samples per rank and
one optimizer step. The three run in turn every iteration (so machine load hits them alike); the
time of a step is the slower rank's; medians over ``--steps`` after 3 warm-up steps. The script
also checks that the three models agree after training (max abs param difference), so the
timings compare runs that compute the same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

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


def deepspeed_engine(args, kw: dict, cfg: OptimizerConfig, stage: int):
    """A fresh ``TinyGPT(**kw)`` wrapped by ``deepspeed.initialize`` at ZeRO ``stage`` (fp32,
    ``torch.optim.AdamW`` as the client optimizer, clipping and buckets as ``cfg`` / ``args``)."""
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
    if stage == 3:  # prefetch one bucket ahead, as paratron's ZeRO-3 prefetches one unit
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

    # DeepSpeed ZeRO-1.
    engine = deepspeed_engine(args, kw, cfg, stage=1)
    ds_model = engine.module

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
        opt.zero_grad()
        for i in range(m):
            # The token mean over the global batch (all tokens valid): each microbatch's mean
            # divided by microbatches x DP ranks, then summed by DDP.
            loss = model(tokens[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb])
            with opt.ddp.last_backward() if i == m - 1 else contextlib.nullcontext():
                (loss / (m * dp)).backward()
        finalize_grads([model], ctx, opt.ddp)
        opt.step()

    times = time_in_turn(["deepspeed", "paratron", "paratron_no_overlap"], args.steps,
                         lambda name, step: deepspeed_step(engine, args, step) if name == "deepspeed"
                         else paratron_step(name, step))
    ds_params = dict(engine.module.named_parameters())
    diffs = {}
    for name, (model, _) in runs.items():
        diffs[name] = max((p.detach() - ds_params[n].detach()).abs().max().item()
                          for n, p in model.named_parameters())
    n_params = sum(p.numel() for p in ds_model.parameters())
    return {"times": times, "max_param_diff_vs_deepspeed": diffs, "params": n_params}


def time_in_turn(names, steps: int, run_step) -> dict[str, list[float]]:
    """Run ``run_step(name, step)`` for every name in turn, ``steps`` + 3 warm-up times; returns
    the slower rank's seconds of each timed step, by name (every rank must call it)."""
    times = {name: [] for name in names}
    for step in range(steps + 3):
        for name in names:
            torch.distributed.barrier()
            t0 = time.perf_counter()
            run_step(name, step)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            if step >= 3:
                times[name].append(t.item())
    return times


def parse_args(description: str, layers: int = 2) -> argparse.Namespace:
    """The tiny GPT's size, the batch and the bucket size from the command line."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    return ap.parse_args()


def main():
    args = parse_args(__doc__.split("\n")[0])
    torch.set_num_threads(1)
    out = run_ranks(_rank, 2, args, timeout=3600)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in out["times"].items()}
    result = {
        "config": vars(args), "params": out["params"],
        "median_step_ms": {k: round(v, 1) for k, v in med.items()},
        "ratio_paratron_vs_deepspeed": round(med["paratron"] / med["deepspeed"], 3),
        "ratio_overlap_on_vs_off": round(med["paratron"] / med["paratron_no_overlap"], 3),
        "max_param_diff_vs_deepspeed": out["max_param_diff_vs_deepspeed"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
