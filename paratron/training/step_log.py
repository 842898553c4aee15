"""The training loop's step records and console lines.

Every value of a step's record is already on the host when the step ends: the optimizer's one
device-to-host read per step (its skip decision) brings the grad norm and the step's loss stats
along (:meth:`paratron.optim.optimizer.Optimizer.step` ``read_along``). :class:`StepLog` writes
the record (``metrics.jsonl``, TensorBoard), calls the callbacks' ``on_step_end`` with it and the
step's host phase times, and every ``logging.log_interval`` steps prints the console line: the
interval's mean throughput, and the device time per phase from the CUDA events (read then, long
after they completed, so without a wait).
"""

from __future__ import annotations


class StepLog:
    """Records of one training run's steps.

    Args:
        cfg: the run's config (sequence length, batch, precision, log interval, iterations).
        ctx: the parallel context (world size, device).
        writer: the :class:`~paratron.training.metrics.MetricsWriter`.
        timer: the loop's :class:`~paratron.training.timers.PhaseTimer`.
        flops_per_token, peak: for TFLOP/s and MFU (:func:`paratron.training.metrics.throughput`).
        printer: ``printer(line)`` shows the console line.
    """

    def __init__(self, cfg, ctx, writer, timer, flops_per_token: float, peak: float, printer) -> None:
        self.cfg, self.ctx, self.writer, self.timer = cfg, ctx, writer, timer
        self.flops_per_token, self.peak, self.printer = flops_per_token, peak, printer
        self.skipped = 0
        self._window: list[float] = []

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` gets a console line."""
        return (iteration % self.cfg.logging.log_interval == 0 or iteration == 1
                or iteration == self.cfg.train.train_iters)

    def record(self, state, callbacks, out, result, lr: float, step_time_s: float) -> dict:
        """Write and announce the record of the step just finished (``state.iteration``)."""
        from paratron.training.metrics import format_log_line, peak_memory_mb, throughput

        vals = out.read()  # host values: read along with the optimizer's skip decision
        self.skipped += int(result.skipped)
        tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_length
        rec = {"iteration": state.iteration, "consumed_tokens": state.consumed_train_samples * self.cfg.model.seq_length,
               "loss": vals["loss"], "lr": lr, "grad_norm": float(result.grad_norm),
               "skipped_iterations": self.skipped, "tokens_per_second": tokens / step_time_s,
               "step_time_s": step_time_s}
        if self.cfg.train.precision == "fp16":
            rec["loss_scale"] = float(result.loss_scale)
        if vals["aux_loss"] is not None:
            rec["aux_loss"] = vals["aux_loss"]
        rec.update(throughput(rec["tokens_per_second"], self.flops_per_token, self.ctx.world_size, self.peak))
        rec["peak_memory_mb"] = peak_memory_mb(self.ctx.device)
        state.metrics.append(rec)
        callbacks.on_step_end(state, rec, dict(self.timer.last_host, step=step_time_s))
        self.writer.write(rec)
        self._window.append(step_time_s)
        if self.due(state.iteration):
            shown = dict(rec, tokens_per_second=len(self._window) * tokens / sum(self._window))
            shown.update(throughput(shown["tokens_per_second"], self.flops_per_token, self.ctx.world_size, self.peak))
            self.printer(format_log_line(shown, self.cfg.train.train_iters) + self._phases())
            self._window = []
        return rec

    def _phases(self) -> str:
        """`` | device ms/step: data 1 | forward_backward 812 | ...`` over the interval's steps."""
        steps = self.timer.read()
        if not steps:
            return ""
        names = sorted({n for s in steps for n in s})
        mean = {n: 1e3 * sum(s.get(n, 0.0) for s in steps) / len(steps) for n in names}
        return " | ms/step " + " ".join(f"{n} {v:.0f}" for n, v in mean.items())
