"""``run_training``: the training loop of ``paratron train``, on every rank.

Flow: parallel context → data → model chunks → DDP + optimizer + LR schedule → resume →
loop over global batches (microbatches through the configured pipeline schedule) → evaluate
every ``train.eval_interval`` → save every ``checkpoint.interval`` and at the end.
SIGTERM/SIGINT finish the current step, save, and exit cleanly (every rank agrees on the step).
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.config import Config, to_toml
from paratron.training.callbacks import CallbackList, TrainState, load_callback
from paratron.training.metrics import MetricsWriter, peak_flops_per_device, plot_losses
from paratron.training.step import rank_actions, run_global_batch
from paratron.training.step_log import StepLog
from paratron.training.timers import PhaseTimer


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop stops after the current step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def restore(self) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)


def _log(ctx, *msg) -> None:
    if ctx.rank == 0:
        print("[paratron]", *msg, flush=True)


def build_context(cfg: Config):
    from paratron.parallel.context import ParallelContext, init_distributed

    init_distributed(cfg.parallel.timeout_s)
    p = cfg.parallel
    return ParallelContext.build(tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                                 expert_tp=p.expert_tensor, order=p.order)


def seed_everything(seed: int, ctx) -> None:
    """Same default stream on every rank of a stage (TP replicas must draw identical dropout
    masks outside TP regions); the TP-region stream lives in the model's RNG tracker."""
    torch.manual_seed(seed + 100 * ctx.pp.rank)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed + 100 * ctx.pp.rank)


def run_training(cfg: Config, run_dir: str | None = None) -> int:
    """Train as configured; returns a process exit code. Call on every rank (under torchrun)."""
    run_dir = Path(run_dir or os.environ.get("PARATRON_RUN_DIR") or "runs/latest")
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    ctx = build_context(cfg)
    try:
        return _train(cfg, ctx, run_dir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: Config, ctx, run_dir: Path) -> int:
    from paratron.training.data_iter import TrainingData

    seed_everything(cfg.train.seed, ctx)
    data = TrainingData.build(cfg, ctx)
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = data.tokenizer.vocab_size
    chunks, ddp, optimizer, scheduler = build_model_and_optimizer(cfg, ctx)
    is_logger = ctx.rank == 0
    if is_logger:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(to_toml(cfg))
    writer = MetricsWriter(run_dir, is_logger, cfg.logging.tensorboard)
    state = TrainState(cfg, ctx, chunks, optimizer, scheduler, run_dir)
    callbacks = CallbackList(builtin_callbacks(cfg, ctx, state) +
                             [load_callback(s, state) for s in cfg.train.callbacks])
    ckpt = build_checkpoint_manager(cfg, ctx)

    warn_if_saving_over(cfg, ctx)
    if ckpt is not None and cfg.checkpoint.load:
        extra = ckpt.load(chunks, optimizer, scheduler)
        if extra:
            state.iteration = int(extra.get("iteration", 0))
            state.consumed_train_samples = int(extra.get("consumed_train_samples", 0))
            state.consumed_valid_samples = int(extra.get("consumed_valid_samples", 0))
            _log(ctx, f"resumed from {cfg.checkpoint.load} at iteration {state.iteration}")

    from paratron.models.flops import flops_per_token

    flops_tok = flops_per_token(cfg.model)
    peak, peak_src = peak_flops_per_device(cfg.train.peak_flops_per_device, ctx.device)
    _log(ctx, f"layout: {ctx.describe()} | schedule {cfg.parallel.schedule} | "
              f"microbatches/step {data.num_microbatches} | params {count_params(chunks, ctx):,}")
    _log(ctx, f"peak FLOP/s per device for MFU: {peak / 1e12:.3f} TFLOP/s ({peak_src})")
    if data.unigram_entropy is not None:
        _log(ctx, f"unigram entropy of the training tokens: {data.unigram_entropy:.4f} nats/token")

    actions = rank_actions(cfg, ctx, data.num_microbatches)  # the same list every step
    stop = StopFlag()
    stop.install()
    callbacks.on_train_start(state)
    gbs = cfg.train.global_batch_size
    timer = PhaseTimer(ctx.device)
    steplog = StepLog(cfg, ctx, writer, timer, flops_tok, peak, lambda line: _log(ctx, line))
    last_val = None
    stopped_early = False
    try:
        while state.iteration < cfg.train.train_iters:
            callbacks.on_step_start(state)
            t0 = time.perf_counter()
            with timer.phase("data"):
                microbatches = data.train_microbatches(state.consumed_train_samples)
            out, result, lr = train_step(cfg, ctx, chunks, optimizer, scheduler, microbatches,
                                         actions=actions, timer=timer, ddp=ddp)
            state.iteration += 1
            state.consumed_train_samples += gbs
            steplog.record(state, callbacks, out, result, lr, time.perf_counter() - t0)
            saving = bool(cfg.checkpoint.interval and state.iteration % cfg.checkpoint.interval == 0)
            if cfg.train.eval_interval and state.iteration % cfg.train.eval_interval == 0:
                last_val = evaluate(cfg, ctx, chunks, data, state, writer, callbacks, actions)
            stop_now = agree_to_stop(ctx, stop.requested or state.should_stop)
            if ckpt is not None and (stop_now or saving):
                save(ckpt, state, callbacks)
            if stop_now:
                _log(ctx, f"stop requested: saved and exiting at iteration {state.iteration}")
                stopped_early = True
                break
        else:
            if not (cfg.train.eval_interval and state.iteration % cfg.train.eval_interval == 0):
                last_val = evaluate(cfg, ctx, chunks, data, state, writer, callbacks, actions)
            if ckpt is not None and not (cfg.checkpoint.interval and
                                         state.iteration % cfg.checkpoint.interval == 0):
                save(ckpt, state, callbacks)
        if ckpt is not None:
            ckpt.wait()
        callbacks.on_train_end(state)
    except BaseException as exc:
        callbacks.on_exception(state, exc)
        raise
    finally:
        stop.restore()
        writer.close()
    if is_logger:
        plot_losses(writer.records, run_dir / "loss.png")
        if last_val is not None and data.unigram_entropy is not None:
            verdict = "below" if last_val < data.unigram_entropy else "NOT below"
            _log(ctx, f"final validation loss {last_val:.4f} vs unigram entropy "
                      f"{data.unigram_entropy:.4f} nats/token: {verdict}")
        _log(ctx, f"metrics: {run_dir / 'metrics.jsonl'} | plot: {run_dir / 'loss.png'}")
    prompt = cfg.train.sample_prompt or data.default_prompt
    if prompt and cfg.train.sample_tokens > 0 and cfg.checkpoint.save and not stopped_early:
        print_sample(cfg, ctx, prompt)
    return 0


def train_step(cfg: Config, ctx, chunks, optimizer, scheduler, microbatches: list[dict], *,
               actions: list | None = None, timer: PhaseTimer | None = None, ddp=None):
    """One optimizer step on one global batch: zero the grads, forward and backward of every
    microbatch through the schedule (grads finalized there, with ``ddp``), optimizer step, LR
    step. One device-to-host read in all: the optimizer's skip decision, which brings the grad
    norm and this step's loss stats along.

    Returns:
        ``(StepOutput, StepResult, lr)`` with host values; ``lr`` is the rate this step used.
    """
    timer = timer or PhaseTimer(ctx.device)
    optimizer.zero_grad()
    with timer.phase("forward_backward"):
        out = run_global_batch(cfg, ctx, chunks, microbatches, forward_only=False,
                               loss_scale=optimizer.loss_scale, actions=actions, ddp=ddp)
    lr = scheduler_lr(scheduler, optimizer)
    with timer.phase("optimizer"):
        result = optimizer.step(read_along=out.stats)  # the loss stats ride on its one read
    out.values_from(result.read_along)
    scheduler.step()
    timer.end_step()
    return out, result, lr


def builtin_callbacks(cfg: Config, ctx, state: TrainState) -> list:
    """The hang watchdog (first, so it sees every step of the other callbacks), when on."""
    if cfg.parallel.hang_timeout_s > 0 and ctx.world_size > 1:
        from paratron.training.watchdog import HangWatchdog

        return [HangWatchdog(state, cfg.parallel.hang_timeout_s)]
    return []


def print_sample(cfg: Config, ctx, prompt: str) -> None:
    """Rank 0 reloads the checkpoint just saved on one process and continues ``prompt``
    (``train.sample_prompt``, else the start of a validation document)."""
    ctx.world.barrier()  # every rank's shards are on disk
    if ctx.rank != 0:
        return
    from paratron.training.generate import generate_text

    text = generate_text(cfg.checkpoint.save, prompt, cfg.train.sample_tokens,
                         temperature=0.8, top_k=40, seed=cfg.train.seed)
    _log(ctx, "sample from the saved checkpoint (temperature 0.8, top-k 40):\n" + text)


def warn_if_saving_over(cfg: Config, ctx) -> None:
    """Say so when ``checkpoint.save`` already holds another run's checkpoints: a save of the
    same step number replaces theirs."""
    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    if not save or ctx.rank != 0:
        return
    latest = Path(save) / "latest"
    if latest.is_file() and not (load and Path(load).resolve() == Path(save).resolve()):
        _log(ctx, f"warning: checkpoint.save={save} already holds checkpoints (latest: "
                  f"{latest.read_text().strip()}); this run's saves go there too and replace any step "
                  "of the same number. Set checkpoint.save to a new directory to keep them apart.")


def agree_to_stop(ctx, local: bool) -> bool:
    """Every rank stops at the same step if any rank was asked to (signals arrive unevenly).
    A host-side all-reduce (gloo; the CPU side of the process groups): the device never waits."""
    t = torch.tensor([1.0 if local else 0.0])
    ctx.world.host_all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0)


def save(ckpt, state: TrainState, callbacks) -> None:
    path = str(ckpt.directory_for(state.iteration)) if hasattr(ckpt, "directory_for") else str(state.iteration)
    callbacks.on_save_start(state, path)
    ckpt.save(state.iteration, state.chunks, state.optimizer, state.scheduler,
              {"iteration": state.iteration,
               "consumed_train_samples": state.consumed_train_samples,
               "consumed_valid_samples": state.consumed_valid_samples})
    callbacks.on_save_end(state, path)


@torch.no_grad()
def evaluate(cfg, ctx, chunks, data, state: TrainState, writer, callbacks, actions=None) -> float | None:
    """Token-mean validation loss over ``train.eval_iters`` global batches."""
    if not data.has_validation or cfg.train.eval_iters < 1:
        return None
    for c in chunks:
        c.eval()
    total, tokens = 0.0, 0
    for _ in range(cfg.train.eval_iters):
        mbs = data.valid_microbatches(state.consumed_valid_samples)
        out = run_global_batch(cfg, ctx, chunks, mbs, forward_only=True, actions=actions)
        total += out.loss * out.num_tokens
        tokens += out.num_tokens
        state.consumed_valid_samples += cfg.train.global_batch_size
    for c in chunks:
        c.train()
    val = total / max(tokens, 1)
    record = {"iteration": state.iteration, "val_loss": val, "val_ppl": math.exp(min(val, 50.0))}
    writer.write(record)
    state.metrics.append(record)
    callbacks.on_evaluate(state, record)
    _log(ctx, f"validation at iteration {state.iteration}: loss {val:.4f} | ppl {record['val_ppl']:.2f}")
    return val


def build_model_and_optimizer(cfg: Config, ctx):
    """Model chunks of this rank, wrapped for data parallelism, with optimizer and LR schedule."""
    from paratron.models.gpt import build_model_chunks
    from paratron.optim import DistributedDataParallel, build_lr_scheduler, build_optimizer, precision_dtype
    from paratron.pipeline.partition import stage_layers

    p = cfg.parallel
    layout = stage_layers(cfg.model.num_layers, p.pipeline, p.virtual_pipeline, p.pipeline_layout, p.schedule)
    chunks = build_model_chunks(cfg.model, ctx, seed=cfg.train.seed, sequence_parallel=p.sequence_parallel,
                                params_dtype=precision_dtype(cfg.train.precision), stage_layers=layout,
                                context_algorithm=p.context_algorithm)
    for c in chunks:
        c.to(ctx.device)
    ddp = DistributedDataParallel(chunks, ctx, grad_dtype=torch.float32, bucket_size_mb=p.bucket_size_mb,
                                  overlap_grad_reduce=p.overlap_grad_reduce,
                                  zero=p.zero, zero3_reshard_after_forward=p.zero3_reshard_after_forward,
                                  zero3_prefetch=p.zero3_prefetch)
    optimizer = build_optimizer(chunks, ctx, cfg.optimizer, ddp, precision=cfg.train.precision)
    scheduler = build_lr_scheduler(cfg.optimizer, cfg.train.train_iters, optimizer)
    return chunks, ddp, optimizer, scheduler


def build_checkpoint_manager(cfg: Config, ctx):
    if not (cfg.checkpoint.save or cfg.checkpoint.load):
        return None
    from paratron.checkpoint.manager import CheckpointManager

    return CheckpointManager(cfg.checkpoint, ctx, cfg)


def scheduler_lr(scheduler, optimizer) -> float:
    lr = getattr(scheduler, "lr", None)
    if lr is None:
        lr = optimizer.param_groups[0]["lr"]
    return float(lr() if callable(lr) else lr)


def count_params(chunks, ctx) -> int:
    """Logical parameter count of the whole model: each logical tensor once, at its full shape."""
    local = {p.logical_name: math.prod(p.shard.global_shape) for c in chunks for p in c.parameters()}
    merged: dict[str, int] = {}
    for d in ctx.world.all_gather_object(local):
        merged.update(d)
    return sum(merged.values())
