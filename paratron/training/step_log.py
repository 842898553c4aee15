"""The per-step record of the training loop and its console line.

A record (one line of ``metrics.jsonl``, the same on every rank) holds ``iteration,
consumed_tokens, loss, lr, grad_norm, skipped_iterations, tokens_per_second, step_time_s,
tflops_per_device, mfu, peak_memory_mb`` (plus ``loss_scale`` under fp16, ``aux_loss`` for
MoE and ``mtp_loss`` with multi-token prediction). The console shows rank 0's record every ``logging.log_interval`` steps (and at step 1),
with the token rate and the device time per phase averaged over the interval;
``metrics.jsonl`` keeps every step. Every value is on the host when the step ends: the loss stats
came with the optimizer's one device-to-host read.
"""

from __future__ import annotations

import math

from paratron.config.record_rules import record_based
from paratron.models.flops import flops_per_token
from paratron.training.metrics import format_log_line, peak_memory_mb


def log(ctx, *msg) -> None:
    """Print on rank 0 only, with the ``[paratron]`` prefix."""
    if ctx.rank == 0:
        print("[paratron]", *msg, flush=True)


def throughput(tokens_per_second: float, flops_per_token: float, world_size: int, peak: float) -> dict:
    """TFLOP/s per device and MFU for a token rate of the whole job."""
    flops = flops_per_token * tokens_per_second / world_size
    mfu = flops / peak if peak and math.isfinite(peak) else float("nan")
    return {"tflops_per_device": flops / 1e12, "mfu": mfu}


class StepLog:
    """Builds each step's record and prints the console line.

    Args:
        cfg: the run's config.
        ctx: the parallel context.
        peak, peak_source: peak FLOP/s per device for MFU and where it came from.
        timer: the loop's :class:`~paratron.training.timers.PhaseTimer`; the console line then
            adds the device time per phase over the interval (CUDA events on a GPU).
    """

    def __init__(self, cfg, ctx, peak: float, peak_source: str, timer=None) -> None:
        self.cfg, self.ctx, self.peak, self.peak_source, self.timer = cfg, ctx, peak, peak_source, timer
        self.flops_per_token = flops_per_token(cfg.model)
        self.skipped = 0
        self._window_tokens, self._window_time = 0, 0.0

    def state_dict(self) -> dict:
        """The counts that run across steps and must survive a resume (carried in every
        checkpoint's ``extra``): ``skipped_iterations`` so far. The console's token-rate window
        is not one of them: it measures the time since the last line of this process."""
        return {"skipped_iterations": self.skipped}

    def load_state_dict(self, d: dict) -> None:
        """Restore :meth:`state_dict` (a checkpoint written before it was saved: 0)."""
        self.skipped = int(d.get("skipped_iterations", 0))

    def header(self, unigram_entropy: float | None) -> None:
        log(self.ctx, f"peak FLOP/s per device for MFU: {self.peak / 1e12:.3f} TFLOP/s ({self.peak_source})")
        if unigram_entropy is not None:
            log(self.ctx, f"unigram entropy of the training tokens: {unigram_entropy:.4f} nats/token")

    def record(self, state, out, result, lr: float, step_time: float) -> dict:
        """The record of the step just finished (``state.iteration`` already counts it)."""
        seq = self.cfg.model.seq_length
        tokens, consumed = self.cfg.train.global_batch_size * seq, state.consumed_train_samples * seq
        if self.cfg.data.microbatch_tokens is not None or record_based(self.cfg):  # varying lengths: count labels
            tokens, consumed = out.num_tokens, state.consumed_train_tokens
        self.skipped += int(result.skipped)
        self._window_tokens += tokens
        self._window_time += step_time
        r = {"iteration": state.iteration,
             "consumed_tokens": consumed,
             "loss": out.loss, "lr": lr, "grad_norm": float(result.grad_norm),
             "skipped_iterations": self.skipped, "tokens_per_second": tokens / step_time,
             "step_time_s": step_time}
        if self.cfg.train.precision == "fp16":
            r["loss_scale"] = float(result.loss_scale)
        if out.aux_loss is not None:
            r["aux_loss"] = out.aux_loss
        if out.mtp_loss is not None:
            r["mtp_loss"] = out.mtp_loss
        r.update(self._throughput(r["tokens_per_second"]))
        r["peak_memory_mb"] = peak_memory_mb(self.ctx.device)
        return r

    def console(self, record: dict) -> None:
        """Print the line every ``logging.log_interval`` steps and at step 1 (the token rate is
        the mean over the steps since the last line)."""
        it = record["iteration"]
        if it % self.cfg.logging.log_interval and it != 1:
            return
        shown = dict(record, tokens_per_second=self._window_tokens / self._window_time)
        shown.update(self._throughput(shown["tokens_per_second"]))
        log(self.ctx, format_log_line(shown, self.cfg.train.train_iters) + self._phases())
        self._window_tokens, self._window_time = 0, 0.0

    def _phases(self) -> str:
        """`` | ms/step data 1 forward_backward 812 optimizer 40``: mean device time per phase
        over the interval's steps (the CUDA events are read here, long after they completed)."""
        steps = self.timer.read() if self.timer is not None else []
        if not steps:
            return ""
        names = sorted({n for st in steps for n in st})
        return " | ms/step " + " ".join(f"{n} {1e3 * sum(st.get(n, 0.0) for st in steps) / len(steps):.0f}"
                                         for n in names)

    def _throughput(self, tokens_per_second: float) -> dict:
        return throughput(tokens_per_second, self.flops_per_token, self.ctx.world_size, self.peak)
