"""The training loop's step records, read from the device once per log interval.

A step leaves its scalars on the device (:class:`~paratron.training.step.StepOutput` stats, the
optimizer's grad norm and clip coefficient) and its phase timings in a
:class:`~paratron.training.timers.PhaseTimer`. :class:`StepLog` keeps them pending; at each
flush (every ``logging.log_interval`` steps, at the first and the last step, and before an
evaluation, a save or a stop) it stacks every pending scalar into one tensor and copies it to the
host in one transfer, then writes each step's record (``metrics.jsonl``, TensorBoard), calls the
callbacks' ``on_step_end`` for each step in order, and prints the console line (the mean
throughput over the interval). So the host never waits for the device between log points, and
callbacks see every step's record, late by at most one log interval.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingStep:
    iteration: int
    consumed_tokens: int
    out: object  # StepOutput
    result: object  # optimizer StepResult
    lr: float
    step_time_s: float
    skipped_so_far: int


class StepLog:
    """Pending step records of one training run (see the module docstring).

    Args:
        cfg: the run's config (sequence length, batch, precision, log interval, iterations).
        ctx: the parallel context (world size, device, rank 0 prints).
        writer: the :class:`~paratron.training.metrics.MetricsWriter`.
        timer: the loop's :class:`~paratron.training.timers.PhaseTimer` (one step per
            ``end_step``).
        flops_per_token, peak: for TFLOP/s and MFU (:func:`paratron.training.metrics.throughput`).
        printer: ``printer(line)`` shows the console line.
    """

    def __init__(self, cfg, ctx, writer, timer, flops_per_token: float, peak: float, printer) -> None:
        self.cfg, self.ctx, self.writer, self.timer = cfg, ctx, writer, timer
        self.flops_per_token, self.peak, self.printer = flops_per_token, peak, printer
        self.pending: list[PendingStep] = []
        self.skipped = 0

    def add(self, iteration: int, consumed_tokens: int, out, result, lr: float, step_time_s: float) -> None:
        """Queue one finished step (nothing is read from the device)."""
        if isinstance(result.skipped, bool):
            self.skipped += int(result.skipped)
        self.pending.append(PendingStep(iteration, consumed_tokens, out, result, lr, step_time_s, self.skipped))

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` is a log point."""
        return (iteration % self.cfg.logging.log_interval == 0 or iteration == 1
                or iteration == self.cfg.train.train_iters)

    def flush(self, state, callbacks) -> list[dict]:
        """Read every pending step in one transfer, write and announce their records; returns them."""
        if not self.pending:
            return []
        from paratron.training.metrics import format_log_line, peak_memory_mb, throughput

        rows = torch.stack([self._device_row(p) for p in self.pending]).tolist()  # the one sync
        timings = self.timer.read()
        records = []
        for p, row, t in zip(self.pending, rows, timings + [{}] * (len(rows) - len(timings))):
            vals = p.out.values_from(row[:3])
            p.result.set_values(row[3], row[4])
            tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_length
            record = {"iteration": p.iteration, "consumed_tokens": p.consumed_tokens, "loss": vals["loss"],
                      "lr": p.lr, "grad_norm": row[3], "skipped_iterations": p.skipped_so_far,
                      "tokens_per_second": tokens / p.step_time_s, "step_time_s": p.step_time_s}
            if self.cfg.train.precision == "fp16":
                record["loss_scale"] = float(p.result.loss_scale)
            if vals["aux_loss"] is not None:
                record["aux_loss"] = vals["aux_loss"]
            record.update(throughput(record["tokens_per_second"], self.flops_per_token,
                                     self.ctx.world_size, self.peak))
            record["peak_memory_mb"] = peak_memory_mb(self.ctx.device)
            state.metrics.append(record)
            callbacks.on_step_end(state, record, dict(t, step=p.step_time_s))
            self.writer.write(record)
            records.append(record)
        window = sum(p.step_time_s for p in self.pending)
        shown = dict(records[-1], tokens_per_second=len(records) * tokens / window)
        shown.update(throughput(shown["tokens_per_second"], self.flops_per_token, self.ctx.world_size, self.peak))
        self.printer(format_log_line(shown, self.cfg.train.train_iters))
        self.pending = []
        return records

    @staticmethod
    def _device_row(p: PendingStep) -> torch.Tensor:
        """``[loss, aux, tokens, grad_norm, clip_coeff]`` of one step as one fp64 device tensor."""
        stats = p.out.stats
        extra = [v.reshape(1).double() if isinstance(v, torch.Tensor)
                 else torch.tensor([float(v)], dtype=torch.float64, device=stats.device)
                 for v in p.result.device_values()]
        return torch.cat([stats.double()] + extra)
