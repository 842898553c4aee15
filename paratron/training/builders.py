"""What the training loop is built from, on every rank: the seeded default RNG stream, the model
chunks with DDP, optimizer and LR schedule, the checkpoint manager, and the run's small reports
(parameter count, a warning before saving over another run, the final text sample)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from paratron.checkpoint.adapters import merged, with_base
from paratron.checkpoint.hf_export import export_hf
from paratron.checkpoint.hf_load import hf_param_names, load_hf_weights
from paratron.checkpoint.io import load_model_full
from paratron.checkpoint.manager import CheckpointManager, params_to_load
from paratron.checkpoint.peft_export import save_peft
from paratron.config import Config
from paratron.data.prepare import build_tokenizer
from paratron.layers.fp8 import enable_fp8, fp8_weights, recipe_of
from paratron.layers.init import skip_draws
from paratron.models.gpt import build_model_chunks
from paratron.models.lora import adapter_names
from paratron.optim import DistributedDataParallel, build_lr_scheduler, build_optimizer, precision_dtype
from paratron.pipeline.partition import stage_layers
from paratron.training.generate import continue_text, generate_text, hf_export_check
from paratron.training.step_log import log


def seed_everything(seed: int, ctx) -> None:
    """Same default stream on every rank of a stage (TP replicas must draw identical dropout
    masks outside TP regions); the TP-region stream lives in the model's RNG tracker."""
    torch.manual_seed(seed + 100 * ctx.pp.rank)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed + 100 * ctx.pp.rank)


def sample_prompt(setting: str | None, default: str | None) -> str | None:
    """The prompt of the end-of-run text sample: ``train.sample_prompt``, where "auto" means
    ``default`` (the start of a validation document); None: no sample."""
    return default if setting == "auto" else setting


def print_sample(cfg: Config, ctx, prompt: str, saved: str | None, chunks, tokenizer) -> None:
    """Rank 0 continues ``prompt`` with the model as trained, and says where it took it from:
    the checkpoint this run saved last (``saved``, reloaded on one process), else the in-memory
    model where one process holds all of it (``chunks``, encoded by ``tokenizer``). A run over
    several processes that saved no checkpoint prints no sample: its model is split over them."""
    ctx.world.barrier()  # every rank's shards are on disk
    if ctx.rank != 0:
        return
    if saved is None and (ctx.world_size > 1 or len(chunks) > 1):
        log(ctx, f"no text sample: this run saved no checkpoint, and its model is split over "
                 f"{ctx.world_size} processes")
        return

    if saved is not None:
        source = f"the saved checkpoint {saved}"
        text = generate_text(saved, prompt, cfg.train.sample_tokens, temperature=0.8, top_k=40, seed=cfg.train.seed)
    else:
        source = "the in-memory model (this run saved no checkpoint)"
        text = sample_in_memory(cfg, chunks[0], tokenizer, prompt)
    log(ctx, f"sample from {source} (temperature 0.8, top-k 40):\n" + text)


def sample_in_memory(cfg: Config, chunk, tokenizer, prompt: str) -> str:
    """``prompt`` continued by the training run's own one-process ``chunk`` (in eval mode for the
    sample: no dropout), as :func:`generate_text` continues it from a checkpoint."""
    was_training = chunk.training
    chunk.eval()
    try:
        return continue_text(chunk, cfg.model, tokenizer, prompt, cfg.train.sample_tokens, temperature=0.8,
                             top_k=40, seed=cfg.train.seed)
    finally:
        chunk.train(was_training)


def export_hf_at_end(cfg: Config, ctx, run_dir: Path, prompt: str | None) -> None:
    """Rank 0 writes the final checkpoint as a Hugging Face folder (``checkpoint.save_hf``, else
    ``RUN_DIR/hf``) and prints the HF export check (paratron vs transformers, greedy tokens)."""
    ctx.world.barrier()  # every rank's shards are on disk
    if ctx.rank != 0:
        return

    _, tensors = load_model_full(cfg.checkpoint.save)
    tensors = with_base(cfg, tensors)  # an adapter-only checkpoint onto its base
    if cfg.checkpoint.save_peft:
        log(ctx, export_peft(cfg, tensors, Path(cfg.checkpoint.save_peft)))
    model_cfg, tensors = merged(cfg, tensors)  # LoRA: the adapters folded into the base
    out = export_hf(dataclasses.replace(cfg, model=model_cfg), tensors, cfg.checkpoint.save_hf or Path(run_dir) / "hf")
    log(ctx, f"Hugging Face export: {out} (config.json, model.safetensors, tokenizer)")
    ids = build_tokenizer(cfg.data).encode(prompt or "")[:32] if prompt else []
    log(ctx, hf_export_check(model_cfg, tensors, out, [i for i in ids if i < model_cfg.vocab_size] or [0]))


def export_peft(cfg: Config, tensors: dict[str, torch.Tensor], out: Path) -> str:
    """Write a LoRA run's adapters as a ``peft`` folder ``out`` and its frozen base (the full
    ``tensors`` less the adapters) as a Hugging Face folder ``out/base``, which the adapter config
    names; returns the line to print."""
    adapters = set(adapter_names(tensors))
    base_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora_rank=0))
    base = export_hf(base_cfg, {k: v for k, v in tensors.items() if k not in adapters}, out / "base")
    save_peft(cfg.model, tensors, out, base_model=str(base.resolve()))
    return (f"PEFT export: {out} (adapter_model.safetensors, adapter_config.json: {len(adapters)} adapter "
            f"tensors), the base model in {base}")


def warn_if_saving_over(cfg: Config, ctx) -> None:
    """Say so when ``checkpoint.save`` already holds another run's checkpoints: a save of the
    same step number replaces theirs."""
    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    if not save or ctx.rank != 0:
        return
    latest = Path(save) / "latest"
    if latest.is_file() and not (load and Path(load).resolve() == Path(save).resolve()):
        log(ctx, f"warning: checkpoint.save={save} already holds checkpoints (latest: "
                  f"{latest.read_text().strip()}); this run's saves go there too and replace any step "
                  "of the same number. Set checkpoint.save to a new directory to keep them apart.")


def build_model_and_optimizer(cfg: Config, ctx):
    """Model chunks of this rank, wrapped for data parallelism, with optimizer and LR schedule."""
    p = cfg.parallel
    layout = stage_layers(cfg.model.num_layers, p.pipeline, p.virtual_pipeline, p.pipeline_layout, p.schedule)
    # A param the checkpoint will fill is left uninitialised: no draw to overwrite.
    with skip_draws(params_to_load(cfg.checkpoint) | hf_param_names(cfg)):
        chunks = build_model_chunks(cfg.model, ctx, seed=cfg.train.seed, sequence_parallel=p.sequence_parallel,
                                    params_dtype=precision_dtype(cfg.train.precision), stage_layers=layout,
                                    context_algorithm=p.context_algorithm)
    for c in chunks:
        c.to(ctx.device)
    enable_fp8(chunks, recipe_of(cfg.train))  # train.fp8: FP8 column/row-parallel linears
    if chunks and chunks[0].rng_tracker is not None:
        # Hidden dropout on replicated activations must draw the same mask on every TP rank.
        chunks[0].rng_tracker.seed_default_stream()
    ddp = DistributedDataParallel(chunks, ctx, grad_dtype=torch.float32, bucket_size_mb=p.bucket_size_mb,
                                  overlap_grad_reduce=p.overlap_grad_reduce,
                                  zero=p.zero, zero3_reshard_after_forward=p.zero3_reshard_after_forward,
                                  zero3_prefetch=p.zero3_prefetch)
    if cfg.train.fp8_param_gather:  # validated: ZeRO-3 and FP8 on
        ddp.param_shards.enable_fp8_gather(fp8_weights(chunks), ctx.tp)
    optimizer = build_optimizer(chunks, ctx, cfg.optimizer, ddp, precision=cfg.train.precision)
    scheduler = build_lr_scheduler(cfg.optimizer, cfg.train.train_iters, optimizer)
    return chunks, ddp, optimizer, scheduler


def load_hf_start(cfg: Config, ctx, chunks, optimizer) -> None:
    """Fill the model from ``checkpoint.load_hf`` (each rank its own slices) and say so."""
    stats = load_hf_weights(cfg, chunks, optimizer)
    log(ctx, f"loaded {cfg.checkpoint.load_hf} (Hugging Face): rank 0 read {stats.read / 2**20:.1f} MiB "
             f"for {stats.tensors} params, the largest read {stats.largest / 2**20:.1f} MiB")


def build_checkpoint_manager(cfg: Config, ctx):
    if not (cfg.checkpoint.save or cfg.checkpoint.load or cfg.checkpoint.pretrained_checkpoint):
        return None

    return CheckpointManager(cfg.checkpoint, ctx, cfg)


def count_params(chunks, ctx) -> int:
    """Logical parameter count of the whole model: each logical tensor once, at its full shape."""
    local = {p.meta.logical_name: math.prod(p.meta.shard.global_shape) for c in chunks for p in c.parameters()}
    merged: dict[str, int] = {}
    for d in ctx.world.all_gather_object(local):
        merged.update(d)
    return sum(merged.values())
