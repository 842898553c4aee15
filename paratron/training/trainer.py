"""The training loop of ``paratron train``, made of small steps.

:meth:`Trainer.train` is the whole loop and reads on one screen (torchtitan's ``Trainer.train``
is the model): :meth:`~Trainer.train_step`, :meth:`~Trainer.log`, :meth:`~Trainer.maybe_evaluate`,
the stop agreement, :meth:`~Trainer.maybe_save`. Each interval rule belongs to its owner: the
:class:`~paratron.checkpoint.manager.CheckpointManager` decides when to save
(``should_save``), the :class:`~paratron.training.evaluator.Evaluator` when to evaluate, the
:class:`~paratron.training.nonfinite.NonFiniteGuard` what a non-finite step means.

One step (:meth:`Trainer.train_step`): this DP rank's microbatches of the next global batch →
:func:`train_batch`: :func:`~paratron.training.step.run_global_batch` (forward/backward through
the pipeline schedule; the grads are final on return) → ``optimizer.step(read_along=loss
stats)`` (skipped when the global loss or any grad is non-finite; the step's one device-to-host
read) → the LR schedule advances only on an update (Megatron's rule) → the non-finite policy; the
iteration count and data position always advance.
SIGTERM/SIGINT (or a callback's ``state.should_stop``) finish the step, save, and exit 0, on the
same step on every rank.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paratron.checkpoint import rng
from paratron.config import Config, to_toml
from paratron.training.regrid_step import change_pipeline
from paratron.elastic.replace import commit_point
from paratron.training.replace_step import recover
from paratron.elastic.relayout import (RelayoutRefused, agree_on_request, check_request, move_state,
                                       state_items, take_request_file, write_answer)
from paratron.parallel.collcheck import agree_to_stop
from paratron.pipeline.delay import measured_microbatch_time
from paratron.training.callbacks import CallbackList, TrainState, load_callback
from paratron.training.evaluator import Evaluator
from paratron.training.metrics import (METRICS, SUPERSEDED, MetricsWriter, peak_flops_per_device, plot_losses,
                                       read_metrics)
from paratron.training.nonfinite import NonFiniteGuard, NonFiniteStop
from paratron.training.profiling import StepObserver
from paratron.training.builders import (build_checkpoint_manager, build_model_and_optimizer,
                                     count_params, export_hf_at_end, load_hf_start, print_sample, sample_prompt,
                                     seed_everything, warn_if_saving_over)
from paratron.training.data_iter import TrainingData
from paratron.training.step import needs_microbatch_time, rank_actions, run_global_batch
from paratron.training.step_log import StepLog, log
from paratron.training.timers import PhaseTimer
from paratron.training.wandb_log import wandb_sinks


RUN_COUNTERS = ("iteration", "consumed_train_samples", "consumed_valid_samples", "consumed_train_tokens")
"""The :class:`TrainState` counts that every checkpoint carries (:meth:`Trainer.progress`)."""


class StopFlag:
    """Set by SIGTERM/SIGINT while installed (``with StopFlag() as stop:``); the loop stops
    after the current step."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, h in self._previous.items():
            signal.signal(sig, h)


class Trainer:
    """Everything one rank needs to train: data, model chunks, DDP, optimizer, LR schedule,
    checkpoints, evaluation, logging and callbacks (built on every rank, in this order).

    Args:
        cfg: the validated :class:`~paratron.config.Config` (``model.vocab_size`` may be None:
            the tokenizer's size is filled in).
        ctx: the :class:`~paratron.parallel.context.ParallelContext`.
        run_dir: where rank 0 writes ``config.toml``, ``metrics.jsonl``, TensorBoard and
            ``loss.png``.
        clock: the run's :class:`~paratron.launch.startup.StartupClock` (started before the
            rendezvous); the trainer times its own start-up parts on it.
        builtin_callbacks: ``state -> [Callback]``, the callbacks the launcher builds in (the
            hang watchdog), run before ``train.callbacks``; None: none.
    """

    def __init__(self, cfg: Config, ctx, run_dir: Path, clock, builtin_callbacks=None) -> None:
        seed_everything(cfg.train.seed, ctx)
        self.cfg, self.ctx, self.run_dir = cfg, ctx, run_dir
        self.clock = clock
        with self.clock.part("data_index"):
            self.data = TrainingData.build(cfg, ctx)
        if cfg.model.vocab_size is None:
            cfg.model.vocab_size = self.data.tokenizer.vocab_size
        with self.clock.part("model"):
            self.chunks, self.ddp, self.optimizer, self.scheduler = build_model_and_optimizer(cfg, ctx)
        if ctx.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.toml").write_text(to_toml(cfg), encoding="utf-8")
        self.writer = MetricsWriter(run_dir, ctx.rank == 0, cfg.logging.tensorboard,
                                    sinks=wandb_sinks(cfg, run_dir, ctx.rank))
        self.observer = StepObserver(cfg, ctx, run_dir)  # profiler, memory snapshots, timelines
        self.state = TrainState(cfg, ctx, self.chunks, self.optimizer, self.scheduler, run_dir)
        builtin = builtin_callbacks(self.state) if builtin_callbacks is not None else []
        self.callbacks = CallbackList(builtin +
                                      [load_callback(s, self.state) for s in cfg.train.callbacks])
        with self.clock.part("checkpoint_load"):
            self.ckpt = build_checkpoint_manager(cfg, ctx)
        # 1f1b-delay without a configured microbatch time: plain warm-ups until step 1 is measured.
        self.microbatch_time, self.measure_step = None, needs_microbatch_time(cfg)
        self._actions: dict[int, list] = {}  # per microbatch count (token-balanced steps vary it)
        if self.data.num_microbatches is not None:
            self.actions_for(self.data.num_microbatches)  # fixed-length runs: built once, up front
        self.evaluator = Evaluator(cfg, ctx, self.chunks, self.data, self.actions_for)
        self.guard = NonFiniteGuard(cfg.train.nonfinite, cfg.train.max_consecutive_skips)
        self.timer = PhaseTimer(ctx.device)
        self.step_log = StepLog(cfg, ctx, *peak_flops_per_device(cfg.train.peak_flops_per_device,
                                                                 ctx.device), timer=self.timer)
        self.stopping = False
        self.saved = None  # the directory of the last checkpoint this run saved (the end-of-run sample's)
        self.elastic = None  # the ElasticSession of an elastic run (paratron.elastic.regrid)
        self.left = False  # this rank left the job at a pipeline shrink
        self.membership = None  # the elastic launch's Membership (train.replace_dead_ranks)
        self.handed_step_record = None  # a replacement: the survivors' record of the last step
        self.boundary_pending = False  # a step is done and its step boundary not yet (a death may split them)
        self.recovered = None  # the failure record of a rank replaced since the last completed step

    # ---- the loop ------------------------------------------------------------------------
    def train(self, joined: bool = False) -> int:
        """Train to ``train.train_iters`` (or a stop request); returns the exit code: 0, or the
        ``state.exit_code`` a callback set with its stop request.
        ``joined``: a process that joined a running job at a pipeline grow, its state received
        (``paratron.elastic.grow``): no resume. A rank that leaves at a shrink returns 0 there.

        Raises:
            NonFiniteStop: a non-finite step under ``train.nonfinite`` (the same on every rank).
        """
        if not joined:
            with self.clock.part("checkpoint_load"):
                self.resume()
        self.callbacks.on_train_start(self.state)
        with StopFlag() as stop:
            try:
                while not self.stopping and (self.boundary_pending or
                                             self.state.iteration < self.cfg.train.train_iters):
                    try:
                        self.step_and_boundary(stop)
                    except Exception as exc:  # a rank's death: go on without a restart where possible
                        if not recover(self, exc):
                            raise
                    if self.left:
                        return 0  # handed over at a pipeline shrink: nothing more to do here
                if self.stopping:
                    log(self.ctx, f"stop requested: saved and exiting at iteration {self.state.iteration}")
                if self.ckpt is not None:
                    self.ckpt.wait()
                if self.membership is not None:  # a death from now on ends no step (elastic launch)
                    self.membership.mark_trained()
                self.callbacks.on_train_end(self.state)
            except BaseException as exc:
                self.on_exception(exc)
                raise
            finally:
                self.observer.close()
                self.writer.close()
        self.report()
        return self.state.exit_code

    # ---- its steps -----------------------------------------------------------------------
    def step_and_boundary(self, stop: StopFlag) -> None:
        """One step, then its boundary: evaluation, the stop agreement, a save, a re-layout. A
        rank's death after the step's commit point leaves the boundary pending; it is redone
        after the regroup (:mod:`paratron.elastic.replace`)."""
        if not self.boundary_pending:
            record, timings = self.train_step()
            self.boundary_pending = True
            if not self.clock.reported:
                self.log_startup(timings["step"])
            self.log(record, timings)
        last = self.state.iteration >= self.cfg.train.train_iters
        self.maybe_evaluate(last)
        self.stopping = agree_to_stop(self.ctx, stop.requested or self.state.should_stop)
        self.maybe_save(final=last or self.stopping)
        if not (last or self.stopping):
            self.maybe_relayout()
        self.boundary_pending = False

    def train_step(self) -> tuple[dict, dict]:
        """One optimizer step over the next global batch; returns (record, timings)."""
        s, timer = self.state, self.timer
        self.callbacks.on_step_start(s)
        t0 = time.perf_counter()
        with timer.phase("data"):
            microbatches = self.data.train_microbatches(s.consumed_train_samples, s.dp_microbatches)
        with self.observer.step(s.iteration + 1, record=self.measure_step) as timeline:
            with commit_point(self.optimizer, self.membership, s.iteration + 1):
                out, result, lr = train_batch(self.cfg, self.ctx, self.chunks, self.ddp, self.optimizer,
                                              self.scheduler, microbatches, self.actions_for(len(microbatches)),
                                              timer, timeline)
        if self.measure_step:
            self.use_measured_microbatch_time(timeline, len(microbatches))
        warning = self.guard.check(s.iteration + 1, result.nonfinite, self.first_nonfinite)
        if warning:
            log(self.ctx, "warning: " + warning)
        step_time = time.perf_counter() - t0
        s.iteration += 1
        s.consumed_train_samples += self.cfg.train.global_batch_size
        s.consumed_train_tokens += out.num_tokens  # read with the optimizer's one transfer
        record = self.step_log.record(s, out, result, lr, step_time)
        return record, dict(timer.last_host, step=step_time)

    def log_startup(self, first_step_s: float) -> None:
        """Write the ``startup`` record (:mod:`paratron.launch.startup`) once, after the first step (collective)."""
        self.clock.seconds["first_step"] = first_step_s
        record = self.clock.record(self.ctx)
        self.writer.write(record)
        log(self.ctx, self.clock.line(record))

    def actions_for(self, m: int) -> list:
        """This rank's schedule for ``m`` microbatches (an uneven DP split or token-balanced
        microbatches change ``m``; cached)."""
        if m not in self._actions:
            self._actions[m] = rank_actions(self.cfg, self.ctx, m, self.microbatch_time)
        return self._actions[m]

    def use_measured_microbatch_time(self, timeline: list, m: int) -> None:
        """Rebuild the schedule with the compute time per microbatch and stage measured over one
        step (``1f1b-delay``'s warm-ups divide the link latencies by it); the max over all ranks,
        so that every rank builds the same lists (collective)."""
        t = torch.tensor([measured_microbatch_time(timeline, m)], dtype=torch.float64)
        self.ctx.world.host_all_reduce(t, op=dist.ReduceOp.MAX)
        self.microbatch_time, self.measure_step, self._actions = t.item(), False, {}
        if self.data.num_microbatches is not None:  # the evaluator asks actions_for: rebuilt too
            self.actions_for(self.data.num_microbatches)
        log(self.ctx, f"{self.cfg.parallel.schedule}: measured {self.microbatch_time * 1e3:.1f} ms per microbatch "
                      "and stage; schedule rebuilt with the link latencies")

    def log(self, record: dict, timings: dict) -> None:
        """Callbacks, the in-memory and on-disk records, and the console line."""
        self.callbacks.on_step_end(self.state, record, timings)
        self.state.metrics.append(record)
        self.step_log.console(record)
        self.writer.write(record)
        if self.recovered is not None:
            self.log_recovery(record)

    def log_recovery(self, record: dict) -> None:
        """The first step completed after a dead rank was replaced: one ``rank_replaced`` record
        (``detect_to_step_s``: from the launcher seeing the death to the end of this step)."""
        r, now = self.recovered, time.time()
        self.recovered = None
        self.writer.write({"record": "rank_replaced", "iteration": record["iteration"], "dead_rank": r["dead"],
                           "dead_pid": r["pid"], "generation": r["generation"], "detected_at": r["detected"],
                           "step_done_at": now, "detect_to_step_s": now - r["detected"],
                           "regroup_s": r.get("rejoin_s")})

    def maybe_evaluate(self, last: bool) -> None:
        """Evaluate when the :class:`Evaluator` says it is due."""
        if not self.evaluator.due(self.state.iteration, last=last):
            return
        record = self.evaluator.run(self.state)
        self.writer.write(record)
        self.state.metrics.append(record)
        self.callbacks.on_evaluate(self.state, record)
        log(self.ctx, f"validation at iteration {record['iteration']}: loss {record['val_loss']:.4f} | "
                      f"ppl {record['val_ppl']:.2f}")

    def maybe_save(self, *, final: bool) -> None:
        """Save when the checkpoint manager says so (its interval, or ``final``)."""
        if self.ckpt is None or not self.ckpt.should_save(self.state.iteration, final=final):
            return
        s = self.state
        path = str(self.ckpt.directory_for(s.iteration))
        self.callbacks.on_save_start(s, path)
        self.ckpt.save(s.iteration, self.chunks, self.optimizer, self.scheduler, self.progress())
        self.saved = path
        self.callbacks.on_save_end(s, path)

    def maybe_relayout(self) -> None:
        """Apply a re-layout request (a callback's ``state.request_relayout``, or the file of
        ``paratron resize``) agreed by every rank at this step boundary; a request that cannot be
        met is refused with a warning and nothing changes (collective, one host flag per step)."""
        if not self.cfg.train.elastic_relayout:  # no agreement, so no collective per step
            if self.state.relayout_request:
                log(self.ctx, "warning: re-layout request ignored: the run was started without "
                              "train.elastic_relayout=true")
                self.state.relayout_request = None
            return
        local = self.state.relayout_request or take_request_file(self.run_dir, self.ctx.rank)
        self.state.relayout_request = None
        req = agree_on_request(self.ctx, local)
        if req is None:
            return
        p, layout = self.cfg.parallel, req["layout"]
        try:
            if req["pipeline"] not in (None, p.pipeline):  # the grid changes (paratron.elastic.regrid)
                change_pipeline(self, req["pipeline"], layout)
            else:
                check_request(self.cfg, layout)
                self.relayout_to(layout)
        except RelayoutRefused as e:
            message = f"{e}; the run continues with parallel.pipeline={p.pipeline}, pipeline_layout={p.pipeline_layout}"
            log(self.ctx, f"warning: {message}")
            if self.ctx.rank == 0:
                write_answer(self.run_dir, req, "refused", message)
            return
        if self.ctx.rank == 0:  # a leaver is never rank 0 (the last stages leave)
            write_answer(self.run_dir, req, "applied", f"parallel.pipeline={p.pipeline}, pipeline_layout="
                                                       f"{p.pipeline_layout} from iteration {self.state.iteration}")

    def relayout_to(self, layout: list[int]) -> None:
        """Rebuild this rank's chunks, DDP, optimizer and LR schedule for ``layout`` and move the
        state of the layers that change stage point-to-point (:mod:`paratron.elastic.relayout`);
        the RNG streams, the optimizer's counts, the LR schedule and the data position carry over.
        No file is written. Collective."""
        t0 = time.perf_counter()
        streams, old = rng.capture(self.chunks), state_items(self.chunks, self.optimizer)
        before = self.cfg.parallel.pipeline_layout
        self.cfg.parallel.pipeline_layout = layout  # every holder of cfg sees the new split
        chunks, ddp, optimizer, scheduler = build_model_and_optimizer(self.cfg, self.ctx)
        received = torch.tensor([float(move_state(self.ctx, old, state_items(chunks, optimizer)))])
        self.ctx.world.host_all_reduce(received)
        old_optimizer, old_scheduler = self.optimizer, self.scheduler
        self.chunks, self.ddp, self.optimizer, self.scheduler = chunks, ddp, optimizer, scheduler
        self.adopt(old_optimizer.scalar_state(), old_scheduler.state_dict(), streams)
        log(self.ctx, f"re-layout at iteration {self.state.iteration}: parallel.pipeline_layout {before} -> "
                      f"{layout} in memory ({time.perf_counter() - t0:.2f} s; {int(received.item()):,} "
                      "elements of params and optimizer state moved between stages)")

    def adopt(self, scalar_state: dict, scheduler_state: dict, streams: dict | None) -> None:
        """After a re-layout filled the tensors of the rebuilt chunks and optimizer: the
        optimizer's scalar state, the LR schedule's position, the RNG streams (None: as they are),
        the schedule lists and the run's ``config.toml`` (rank 0)."""
        self.optimizer.load_scalar_state(scalar_state)
        self.optimizer.reload_model_params()
        self.scheduler.load_state_dict(scheduler_state)
        if streams is not None:
            rng.restore(self.chunks, streams)
        self.state.chunks, self.state.optimizer, self.state.scheduler = self.chunks, self.optimizer, self.scheduler
        self.evaluator.chunks, self._actions = self.chunks, {}
        if self.data.num_microbatches is not None:
            self.actions_for(self.data.num_microbatches)
        if self.ctx.rank == 0:  # the run's record says the layout it trains at now
            (self.run_dir / "config.toml").write_text(to_toml(self.cfg), encoding="utf-8")

    # ---- around the loop -----------------------------------------------------------------
    def resume(self) -> None:
        """Load ``checkpoint.load`` if set, and print the run's header lines."""
        s, cfg = self.state, self.cfg
        warn_if_saving_over(cfg, self.ctx)
        # LoRA: the frozen base from Hugging Face first; an adapter-only checkpoint.load then resumes.
        hf_base = bool(cfg.checkpoint.load_hf) and cfg.model.lora_rank > 0
        if hf_base:
            load_hf_start(cfg, self.ctx, self.chunks, self.optimizer)
        extra = self.ckpt.load_everywhere(self.chunks, self.optimizer, self.scheduler) if (
            self.ckpt is not None and (cfg.checkpoint.load or cfg.checkpoint.pretrained_checkpoint)) else None
        if extra:
            self.restore_progress(extra)
            log(self.ctx, f"resumed from {cfg.checkpoint.load} at iteration {s.iteration}")
            note = data_position_mismatch(extra, cfg)
            if note:
                log(self.ctx, "warning: " + note)
        elif cfg.checkpoint.load_hf and not hf_base:
            load_hf_start(cfg, self.ctx, self.chunks, self.optimizer)
        moved = self.writer.start(s.iteration)
        if moved:
            log(self.ctx, f"{moved} lines of {self.run_dir / METRICS} after iteration {s.iteration} (left by an "
                          f"earlier run; this run redoes them) moved to {SUPERSEDED}")
        per_step = self.data.num_microbatches or f"token-balanced (data.microbatch_tokens={cfg.data.microbatch_tokens})"
        log(self.ctx, f"layout: {self.ctx.describe()} | schedule {cfg.parallel.schedule} | microbatches/step "
                      f"{per_step} | params {count_params(self.chunks, self.ctx):,}")
        self.step_log.header(self.data.unigram_entropy)

    def progress(self) -> dict:
        """Every count that accumulates across steps, for each checkpoint's ``extra``: the
        iteration and data position (:data:`RUN_COUNTERS` of the :class:`TrainState`), the
        skipped iterations (:class:`StepLog`), the non-finite steps in a row
        (:class:`NonFiniteGuard`), the unit of the data position and what the data reader keeps
        (``TrainingData.state_dict``). The optimizer's scalar
        state carries its own counts (step count, loss scale with its growth and hysteresis
        trackers), the scheduler its position."""
        s = self.state
        return {**{k: getattr(s, k) for k in RUN_COUNTERS}, **self.step_log.state_dict(),
                **self.guard.state_dict(), "data_position_unit": data_position_unit(self.cfg),
                "data_state": self.data.state_dict()}

    def restore_progress(self, extra: dict) -> None:
        """Set the counts of :meth:`progress` from a loaded checkpoint's ``extra`` (a count that
        an older checkpoint lacks starts at 0)."""
        for k in RUN_COUNTERS:
            setattr(self.state, k, int(extra.get(k, 0)))
        self.step_log.load_state_dict(extra)
        self.guard.load_state_dict(extra)
        self.data.load_state_dict(extra.get("data_state") or {})  # a streamed dataset's pass length

    def first_nonfinite(self) -> str:
        """The lowest rank with a non-finite grad and its first such param (a collective: only
        called on the rare non-finite step, on every rank)."""
        found = self.ctx.world.all_gather_object(self.optimizer.first_nonfinite_param())
        for rank, name in enumerate(found):
            if name is not None:
                return f"first non-finite grad: {name} on rank {rank}"
        return "the loss is non-finite; every grad is finite"

    def on_exception(self, exc: BaseException) -> None:
        self.callbacks.on_exception(self.state, exc)
        if isinstance(exc, NonFiniteStop) and self.ckpt is not None:
            self.ckpt.wait()  # every rank stops here: the last good save in flight completes

    def report(self) -> None:
        """Rank 0: the loss plot and the final lines; then the text sample, unless stopped."""
        if self.ctx.rank == 0:
            plot_losses(read_metrics(self.run_dir / METRICS), self.run_dir / "loss.png")
            val, entropy = self.evaluator.last_loss, self.data.unigram_entropy
            if val is not None and entropy is not None:
                verdict = "below" if val < entropy else "NOT below"
                log(self.ctx, f"final validation loss {val:.4f} vs unigram entropy {entropy:.4f} "
                              f"nats/token: {verdict}")
            log(self.ctx, f"metrics: {self.run_dir / METRICS} | plot: {self.run_dir / 'loss.png'}")
        try:
            self.end_of_run_outputs()
        except Exception as exc:  # noqa: BLE001 - only where a peer may die (replace_dead_ranks)
            if self.membership is None:
                raise
            # The training and its last checkpoint are done: a peer that dies now ends nothing
            # the launcher could redo (it finishes the job with the survivors' exit 0).
            log(self.ctx, f"warning: the end-of-run sample/export did not finish (a rank ended during it: "
                          f"{type(exc).__name__}); the training and its last checkpoint are complete")

    def end_of_run_outputs(self) -> None:
        """The text sample and the Hugging Face export of the last checkpoint, where configured
        (collective)."""
        prompt = sample_prompt(self.cfg.train.sample_prompt, self.data.default_prompt)
        if prompt and self.cfg.train.sample_tokens > 0 and not self.stopping:
            print_sample(self.cfg, self.ctx, prompt, self.saved, self.chunks, self.data.tokenizer)
        if self.cfg.train.export_hf_at_end and self.cfg.checkpoint.save and not self.stopping:
            export_hf_at_end(self.cfg, self.ctx, self.run_dir, prompt or self.data.default_prompt)


def data_position_unit(cfg: Config) -> str:
    """What ``consumed_train_samples`` counts: whole documents in token-balanced runs
    (``data.microbatch_tokens``), fixed-length samples of ``model.seq_length`` otherwise."""
    return "documents" if cfg.data.microbatch_tokens is not None else "samples"


def data_position_mismatch(extra: dict, cfg: Config) -> str | None:
    """A warning when a checkpoint's data position was counted in other units than this run reads
    (``data.microbatch_tokens`` set on one side only): position N then names other text, so some
    of the corpus is read twice or skipped. None when they agree, or for a checkpoint written
    before the unit was recorded."""
    saved, now = extra.get("data_position_unit"), data_position_unit(cfg)
    if saved is None or saved == now:
        return None
    return (f"the checkpoint's data position ({extra.get('consumed_train_samples', 0)} {saved}) was counted "
            f"with data.microbatch_tokens {'set' if saved == 'documents' else 'unset'}, and this run has it "
            f"{'set' if now == 'documents' else 'unset'}: it reads on from {now[:-1]} "
            f"{extra.get('consumed_train_samples', 0)} of its own stream, not where the saved run stopped "
            "(some text is read twice or skipped)")


def train_batch(cfg: Config, ctx, chunks, ddp, optimizer, scheduler, microbatches: list[dict],
                actions: list | None = None, timer: PhaseTimer | None = None, timeline: list | None = None):
    """The device work of one step: zero the grads, forward and backward of every microbatch
    through the schedule (grads final on return), the optimizer step (skipped when the global
    loss or any grad is non-finite), the LR schedule (only after an update). One device-to-host
    read in all: the optimizer's skip decision, which brings the grad norm and the step's loss
    stats along. ``timeline``: if given, the pipeline's per-action events are appended to it.

    Returns:
        ``(StepOutput, StepResult, lr)`` with host values; ``lr`` is the rate this step used.
    """
    timer = timer or PhaseTimer(ctx.device)
    optimizer.zero_grad()
    with timer.phase("forward_backward"):
        out = run_global_batch(cfg, ctx, chunks, microbatches, forward_only=False,
                               loss_scale=optimizer.loss_scale, actions=actions, ddp=ddp, timeline=timeline)
    lr = float(scheduler.lr)
    with timer.phase("optimizer"):
        result = optimizer.step(read_along=out.stats)
    out.values_from(result.read_along)
    if not result.skipped:
        scheduler.step()
    timer.end_step()
    return out, result, lr
