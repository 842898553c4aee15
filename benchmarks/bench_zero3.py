"""ZeRO-2/3 at DP=2: paratron against DeepSpeed ZeRO stages 2/3 and torch FSDP2 (``fully_shard``),
and prefetch on against off.

Usage::

    DS_ACCELERATOR=cpu DS_BUILD_OPS=0 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_zero3.py [--steps 10]

DeepSpeed: ``DS_BUILD_OPS=0 .venv/bin/pip install deepspeed`` (0.19.8 measured; no compiled op is
needed: the client optimizer is ``torch.optim.AdamW``).

Two gloo ranks (forked, one thread each) hold seven copies of the same tiny GPT of
``bench_zero.py`` (plain PyTorch, tied output layer), with the same init:

* paratron ZeRO-3 (``DistributedDataParallel(zero=3)``): each block is a unit, the embeddings
  and final norm a unit spanning the forward; prefetch on;
* the same with prefetch off;
* torch FSDP2: ``fully_shard`` on each block and on the root, ``reshard_after_forward=True``
  (ZeRO-3), ``torch.optim.AdamW``, ``clip_grad_norm_``;
* paratron ZeRO-2 (``zero=2``);
* torch FSDP2 with ``reshard_after_forward=False`` on every module (params stay gathered from
  forward to backward; grads and optimizer state sharded: FSDP's ZeRO-2 mode);
* DeepSpeed ZeRO stage 3 and stage 2 (``bench_zero.deepspeed_engine``: fp32, ``torch.optim.AdamW``
  as the client optimizer, 1 MB buckets; stage 3 with every param partitioned
  (``stage3_param_persistence_threshold=0``) and a prefetch of one bucket).

AdamW (lr 1e-3, weight decay 0.1 on matrices), clipping at 1.0; one step = ``--microbatches``
forward/backward passes of ``--micro-batch`` samples per rank and one optimizer step. The seven run
in turn every iteration (so machine load hits them alike); the time of a step is the slower rank's;
medians over ``--steps`` after 3 warm-up steps. Memory is the bytes of each rank's params, grads
and optimizer state alive right after the optimizer step, summed from the tensors themselves
(local shards for FSDP2; for DeepSpeed every tensor its ZeRO optimizer holds, see
``_deepspeed_bytes``); for paratron ZeRO-3 also the most full-param bytes gathered at once.
The script checks that all seven end with the same params (max abs difference).
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

from bench_zero import TinyGPT, _data, deepspeed_engine, deepspeed_step, parse_args, time_in_turn  # noqa: E402
from paratron.config import OptimizerConfig  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402


def _fsdp(kw, cfg, reshard: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = TinyGPT(**kw)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    decay = [p for p in model.parameters() if p.dim() > 1]
    nodecay = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": nodecay, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    return model, opt


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


def _rank(args):
    from paratron.optim import DistributedDataParallel, build_optimizer, finalize_grads
    from paratron.optim.zero import storage_bytes
    from paratron.parallel.context import ParallelContext

    rank, dp = torch.distributed.get_rank(), torch.distributed.get_world_size()
    kw = dict(vocab=args.vocab, h=args.hidden, layers=args.layers, heads=args.heads, seq=args.seq)
    mb, m = args.micro_batch, args.microbatches
    cfg = OptimizerConfig(name="adamw", lr=1e-3, weight_decay=0.1, clip_grad=1.0)
    ctx = ParallelContext.build()
    runs = {}
    for name, zero, prefetch in (("paratron_zero3", 3, True), ("paratron_zero3_no_prefetch", 3, False),
                                 ("paratron_zero2", 2, True)):
        model = TinyGPT(**kw)
        ddp = DistributedDataParallel([model], ctx, bucket_size_mb=args.bucket_mb, zero=zero,
                                      zero3_prefetch=prefetch)
        runs[name] = ("paratron", model, build_optimizer([model], ctx, cfg, ddp))
    runs["fsdp2_zero3"] = ("fsdp", *_fsdp(kw, cfg, True))
    runs["fsdp2_zero2"] = ("fsdp", *_fsdp(kw, cfg, False))
    for stage in (3, 2):
        engine = deepspeed_engine(args, kw, cfg, stage=stage)
        runs[f"deepspeed_zero{stage}"] = ("deepspeed", engine, None)

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
            opt.step()
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
            opt.step()

    times = time_in_turn(list(runs), args.steps, step)
    peak = runs["paratron_zero3"][2].ddp.param_shards.peak_gathered_bytes  # before full_params below
    memory, full = {}, {}
    for name, (kind, model, opt) in runs.items():
        if kind == "paratron":
            held = opt.ddp.model_state_tensors()
            memory[name] = storage_bytes(held["params"] + held["grads"]) + opt.state_bytes()
            with opt.ddp.full_params():
                full[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
        elif kind == "deepspeed":
            memory[name], full[name] = _deepspeed_bytes(model), _deepspeed_full(model)
        else:
            memory[name] = _fsdp_bytes(model, opt)
            full[name] = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    ref = full["fsdp2_zero3"]
    diffs = {name: max((t - ref[n]).abs().max().item() for n, t in f.items()) for name, f in full.items()}
    n_params = sum(t.numel() for t in ref.values())
    return {"times": times, "memory": memory, "diff": diffs, "params": n_params, "zero3_peak_gathered": peak}


def main():
    args = parse_args(__doc__.split("\n")[0], layers=4)
    torch.set_num_threads(1)
    out = run_ranks(_rank, 2, args, timeout=3600)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in out["times"].items()}
    mem = out["memory"]
    result = {
        "config": vars(args), "params": out["params"], "load_average": os.getloadavg(),
        "median_step_ms": {k: round(v, 1) for k, v in med.items()},
        "model_state_bytes_per_rank": mem,
        "zero3_peak_gathered_bytes": out["zero3_peak_gathered"],
        "time_zero3_vs_fsdp2": round(med["paratron_zero3"] / med["fsdp2_zero3"], 3),
        "time_zero2_vs_fsdp2_zero2": round(med["paratron_zero2"] / med["fsdp2_zero2"], 3),
        "time_prefetch_on_vs_off": round(med["paratron_zero3"] / med["paratron_zero3_no_prefetch"], 3),
        "memory_zero3_vs_fsdp2": round(mem["paratron_zero3"] / mem["fsdp2_zero3"], 3),
        "memory_zero2_vs_fsdp2_zero2": round(mem["paratron_zero2"] / mem["fsdp2_zero2"], 3),
        "time_zero3_vs_deepspeed3": round(med["paratron_zero3"] / med["deepspeed_zero3"], 3),
        "time_zero2_vs_deepspeed2": round(med["paratron_zero2"] / med["deepspeed_zero2"], 3),
        "memory_zero3_vs_deepspeed3": round(mem["paratron_zero3"] / mem["deepspeed_zero3"], 3),
        "memory_zero2_vs_deepspeed2": round(mem["paratron_zero2"] / mem["deepspeed_zero2"], 3),
        "max_param_diff_vs_fsdp2": out["diff"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
