"""ZeRO-2/3 at DP=2: paratron against torch FSDP2 (``fully_shard``) and DeepSpeed ZeRO stages 2/3,
each set up as its users would (fair) and at paratron's settings (matched), and against the
same work with no sharding at all.

Usage::

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_zero3.py \
        [--size small|large] [--stage 3|2] [--steps 30]

DeepSpeed: ``DS_BUILD_OPS=0 .venv/bin/pip install deepspeed`` (0.19.8 measured; no compiled op is
needed: the client optimizer is ``torch.optim.AdamW``).

Sizes (``--size``): ``small`` is the tiny GPT of ``bench_zero.py`` with 4 blocks (h=128, 1.06M
params: framework overhead dominates); ``large`` the same at h=512 (13.7M params, 12.9x; h >= 512:
the GEMMs dominate). Two gloo ranks (forked, one thread each) hold these copies of the model, with
the same init, and take their steps in turn (``pairing.time_paired``: order reversed every other
step), the slower rank's time per step:

* ``single``: each rank trains its own unsharded copy on its share of the batch with
  ``torch.optim.AdamW(foreach=True)`` and no communication at all: the same work per rank with
  no ZeRO, the floor the ZeRO step is measured against;
* ``paratron``: ``DistributedDataParallel(zero=stage)`` (stage 3: each block a unit, the
  embeddings and final norm a unit spanning the forward; prefetch on);
* ``paratron_keep`` (stage 3, when asked for): the same with ``zero3_reshard_after_forward=False``:
  each unit gathered once a step and kept over the microbatches (the params are sharded between
  steps; within one, as ZeRO-2's memory);
* ``fsdp2``: ``fully_shard`` on each block and the root (stage 3: ``reshard_after_forward=True``,
  stage 2: ``False``);
* ``deepspeed``: ``deepspeed.initialize`` at the stage.

``--peers fair`` (default) sets each up as its users would: paratron at its default 40 MB
buckets; FSDP2 with ``torch.optim.AdamW(foreach=True)`` and explicit forward and backward prefetch
of the neighbouring block (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``);
DeepSpeed at its default buckets, prefetch and param persistence, with ``overlap_comm`` on.
``--peers matched`` uses the settings the earlier tables used: paratron and DeepSpeed at
``--bucket-mb`` (1 MB) buckets, DeepSpeed with ``overlap_comm`` off and (stage 3) every param
partitioned and a one-bucket prefetch, FSDP2 with the for-loop AdamW (its CPU default) and
implicit prefetch only. (Two DeepSpeed stage-3 engines in one process hang, hence one set per run.)

AdamW (lr 1e-3, weight decay 0.1 on matrices), clipping at 1.0; one step = ``--microbatches``
forward/backward passes of ``--micro-batch`` samples per rank and one optimizer step. Reported:
median ms per variant and the paired ratio (median of per-step ratios, interquartile range,
min-max) of every variant against ``paratron``, ``--variants`` picks the copies timed (paratron and
fsdp2 always: the large size with all four takes long on a loaded machine), ``--steps`` timed steps after 3 warm-up, load
average before and after. Memory is the bytes of each rank's params, grads and optimizer state
alive right after the optimizer step, summed from the tensors themselves (local shards for FSDP2;
for DeepSpeed every tensor its ZeRO optimizer holds, see ``_deepspeed_bytes``); for paratron
ZeRO-3 also the most full-param bytes gathered at once. The script checks that every sharded
copy ends with the same params as ``fsdp2`` (max abs difference; ``single`` trains on its rank's
data only and is left out).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_zero import TinyGPT, _data, deepspeed_engine, deepspeed_step, parse_args  # noqa: E402
from pairing import MIN_TIMED_STEPS, add_size_arg, load, summarize, time_paired  # noqa: E402
from paratron.config import OptimizerConfig  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402


def _adamw(params, cfg, foreach: bool | None):
    decay = [p for p in params if p.dim() > 1]
    nodecay = [p for p in params if p.dim() == 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": nodecay, "weight_decay": 0.0}], lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=foreach)


def _fsdp(kw, cfg, reshard: bool, fair: bool):
    """FSDP2 over each block and the root; ``fair``: foreach AdamW and explicit prefetch of the
    neighbouring block in forward and backward (else the for-loop AdamW, FSDP2's CPU default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TinyGPT(**kw)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if fair:
        blocks = list(model.blocks)
        for i, blk in enumerate(blocks):
            if i + 1 < len(blocks):
                blk.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                blk.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model, _adamw(list(model.parameters()), cfg, True if fair else None)


def _fsdp_bytes(model, opt) -> int:
    from paratron.optim.zero import storage_bytes

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    return storage_bytes(tensors)


def _tensors_in(obj, depth: int = 3):
    """The tensors in ``obj`` and in the lists, tuples and dicts (keys and values) it nests."""
    if torch.is_tensor(obj):
        yield obj
    elif depth and isinstance(obj, (list, tuple, dict)):
        items = list(obj.items()) if isinstance(obj, dict) else obj
        for item in items:
            yield from _tensors_in(item, depth - 1)


def _deepspeed_bytes(engine) -> int:
    """Bytes of every tensor a DeepSpeed ZeRO engine's rank holds for params, grads and optimizer
    state: the module's params (``ds_tensor``: the stage-3 shard; ``data`` is empty when released)
    and grads, every tensor attribute of the ZeRO optimizer (fp32 partitions, flat buffers, grad
    partitions and reduce buckets) and the client AdamW's state."""
    from paratron.optim.zero import storage_bytes

    tensors = []
    for p in engine.module.parameters():
        tensors += [t for t in (p.data, getattr(p, "ds_tensor", None), p.grad) if t is not None]
    for value in vars(engine.optimizer).values():
        tensors += list(_tensors_in(value))
    tensors += [v for st in engine.optimizer.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v) and v.dim()]
    return storage_bytes(t for t in tensors if t.numel())


def _deepspeed_full(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):  # a no-op below stage 3
        return {n: p.detach().clone() for n, p in params.items()}


def _variants(args, kw, cfg, ctx, stage: int) -> dict:
    """The copies of the model this run times (see the module docstring), by name."""
    from paratron.optim import DistributedDataParallel, build_optimizer

    fair = args.peers == "fair"
    single = TinyGPT(**kw)
    runs = {"single": ("single", single, _adamw(list(single.parameters()), cfg, True))}
    model = TinyGPT(**kw)
    ddp = DistributedDataParallel([model], ctx, bucket_size_mb=40.0 if fair else args.bucket_mb, zero=stage)
    runs["paratron"] = ("paratron", model, build_optimizer([model], ctx, cfg, ddp))
    if "paratron_keep" in args.variants and stage == 3:  # params gathered once a step, kept over the microbatches
        keep = TinyGPT(**kw)
        kept = DistributedDataParallel([keep], ctx, bucket_size_mb=40.0 if fair else args.bucket_mb, zero=3,
                                       zero3_reshard_after_forward=False)
        runs["paratron_keep"] = ("paratron", keep, build_optimizer([keep], ctx, cfg, kept))
    runs["fsdp2"] = ("fsdp", *_fsdp(kw, cfg, stage == 3, fair=fair))
    if "deepspeed" in args.variants:
        runs["deepspeed"] = ("deepspeed", deepspeed_engine(args, kw, cfg, stage=stage, fair=fair), None)
    return {n: r for n, r in runs.items() if n in args.variants or n in ("paratron", "fsdp2")}


def _rank(args):
    from paratron.optim import finalize_grads
    from paratron.optim.zero import storage_bytes
    from paratron.parallel.context import ParallelContext

    rank, dp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    kw = dict(vocab=args.vocab, h=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq)
    mb, m = args.micro_batch, args.microbatches
    cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    ctx = ParallelContext.build()
    runs = _variants(args, kw, cfg, ctx, args.stage)

    def step(name, i):
        kind, model, opt = runs[name]
        if kind == "deepspeed":
            return deepspeed_step(model, args, i)
        tokens, labels = _data(args, i, rank)
        opt.zero_grad()
        for j in range(m):
            loss = model(tokens[j * mb:(j + 1) * mb], labels[j * mb:(j + 1) * mb])
            # paratron sums grads over DP, FSDP2 averages them: the same global token mean.
            (loss / (m * dp) if kind == "paratron" else loss / m).backward()
        if kind == "paratron":
            finalize_grads([model], ctx, opt.ddp)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()

    times = time_paired(list(runs), args.steps, step)
    peak = runs["paratron"][2].ddp.param_shards.peak_gathered_bytes if args.stage == 3 else None
    memory, full = {}, {}
    for name, (kind, model, opt) in runs.items():
        if kind == "paratron":
            held = opt.ddp.model_state_tensors()
            memory[name] = storage_bytes(held["params"] + held["grads"]) + opt.state_bytes()
            with opt.ddp.full_params():
                full[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        elif kind == "deepspeed":
            memory[name], full[name] = _deepspeed_bytes(model), _deepspeed_full(model)
        elif kind == "fsdp":
            memory[name] = _fsdp_bytes(model, opt)
            full[name] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    ref = full["fsdp2"]
    diffs = {name: max((t - ref[n]).abs().max().item() for n, t in f.items()) for name, f in full.items()}
    n_params = sum(t.numel() for t in ref.values())
    return {"times": times, "memory": memory, "diff": diffs, "params": n_params, "zero3_peak_gathered": peak}


SIZES = {"small": {"hidden": 128}, "large": {"hidden": 512}}
VARIANTS = ("single", "paratron", "paratron_keep", "fsdp2", "deepspeed")


def main():
    args = parse_args(__doc__.split("\n")[0], layers=4, steps=MIN_TIMED_STEPS,
                      extra=lambda ap: (add_size_arg(ap), ap.add_argument("--stage", type=int, choices=(2, 3), default=3),
                                        ap.add_argument("--peers", choices=("fair", "matched"), default="fair"),
                                        ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                                                        help="which copies to time (paratron and fsdp2 always)")))
    for k, v in SIZES[args.size].items():
        setattr(args, k, v)
    torch.set_num_threads(1)
    before = load()
    out = run_ranks(_rank, 2, args, timeout=3600)[0]
    times = out["times"]
    pairs = [(p, "single") for p in ("paratron", "paratron_keep") if p in times and "single" in times]
    summary = summarize(times, base="paratron", pairs=pairs)
    mem = out["memory"]
    result = {
        "config": vars(args), "params": out["params"], "load_before": before, "load_after": load(),
        **summary,
        "model_state_bytes_per_rank": mem,
        "memory_vs_paratron": {k: round(v / mem["paratron"], 3) for k, v in mem.items()},
        "zero3_peak_gathered_bytes": out["zero3_peak_gathered"],
        "max_param_diff_vs_fsdp2": out["diff"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
