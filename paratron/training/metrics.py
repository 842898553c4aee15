"""Throughput, MFU, and where the records go: console, ``metrics.jsonl``, TensorBoard, ``loss.png``.

MFU (model FLOPs utilisation, Chowdhery et al. 2022, appendix B) = achieved model FLOP/s per
device / peak FLOP/s per device. Model FLOPs per token come from one formula
(``paratron.models.flops.flops_per_token``). The peak comes from ``train.peak_flops_per_device``,
else from a table of known GPUs (dense bf16 tensor-core peaks from the vendors' data sheets), else,
on CPU, from a measured fp32 matmul on one thread (a rank's share of the CPU); the log says which.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

# Dense (no sparsity) bf16 peak FLOP/s, from NVIDIA/AMD data sheets.
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "V100": 125e12,
    "MI300X": 1307e12,
    "B200": 2250e12,
}


def measure_cpu_matmul_flops(n: int = 512, trials: int = 12) -> float:
    """Peak FLOP/s of an fp32 ``n x n`` matmul (2 n^3 FLOPs) on the current thread settings.

    The best of ``trials`` single matmuls: ranks sharing cores, or other work, slow some trials
    down, and the fastest one is the closest to what one uncontended core can do.
    """
    # A private generator: drawing from the global one would shift the RNG stream of a resumed run.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops_per_device(configured: float | None, device: torch.device) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained)."""
    if configured:
        return float(configured), "train.peak_flops_per_device"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, v in GPU_PEAK_BF16.items():
            if key in name:
                return v, f"table ({name}, dense bf16)"
        return float("nan"), f"unknown GPU {name!r}: set train.peak_flops_per_device"
    return measure_cpu_matmul_flops(), "measured: best fp32 512x512 matmul on one CPU thread"


def scalars(record: dict) -> tuple[int, dict[str, float]]:
    """``(step, {name: value})``: what TensorBoard and Weights & Biases log of a record, its
    finite numbers at its ``iteration`` (0 for a record without one, e.g. ``startup``)."""
    values = {k: v for k, v in record.items()
              if k != "iteration" and isinstance(v, (int, float)) and math.isfinite(v)}
    return record.get("iteration", 0), values


METRICS = "metrics.jsonl"
SUPERSEDED = "metrics.superseded.jsonl"


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, in order; [] when there is none. A line that is not a
    whole JSON object (the last one, when a writer was killed mid-line) is left out. After a
    resume into its own run directory the file holds exactly the current record of every
    iteration (see :meth:`MetricsWriter.start`), so every reader and the loss plot read it whole.
    """
    return [r for r in (_parse(line) for line in _lines(path)) if r is not None]


def _lines(path: Path) -> list[str]:
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []


def _parse(line: str) -> dict | None:
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) else None


def split_at_resume(lines: list[str], iteration: int) -> int:
    """Where the records of a run that resumes after ``iteration`` begin to be replaced: the
    index of the first line that is not a whole record or that records a later iteration (a
    run's records are in iteration order, so everything from there on is redone by the resumed
    run, ``startup`` records of the replaced launches included); ``len(lines)`` when none."""
    for i, line in enumerate(lines):
        r = _parse(line)
        if r is None or int(r.get("iteration", 0)) > iteration:
            return i
    return len(lines)


class MetricsWriter:
    """Writes records to ``RUN_DIR/metrics.jsonl`` and TensorBoard (rank 0 only).

    Training records carry ``iteration, loss, grad_norm, lr, tokens_per_second`` (and more);
    validation records carry ``iteration, val_loss, val_ppl``. These names are a public interface.
    ``sinks``: more writers (``write(record)``, ``close()``) given every record, e.g.
    :class:`~paratron.training.wandb_log.WandbWriter`. Nothing is opened before :meth:`start`,
    which the trainer calls once it knows the iteration the run continues from.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, sinks: list | None = None):
        self.enabled, self.run_dir, self.tensorboard = enabled, Path(run_dir), tensorboard
        self.sinks = list(sinks or []) if enabled else []
        self._jsonl = None
        self._tb = None

    def start(self, iteration: int) -> int:
        """Open the files for a run that continues after ``iteration`` (0: a fresh start).

        Records of later iterations that an earlier run left in ``metrics.jsonl`` (a run killed
        after its last checkpoint, resumed into its own run directory) are moved, marked with
        ``superseded_by_resume_at``, to ``metrics.superseded.jsonl``, so that ``metrics.jsonl``
        keeps one record per iteration: the current one. They are appended there before
        ``metrics.jsonl`` is replaced (atomically), so a crash in between loses none. TensorBoard
        discards its events from step ``iteration + 1`` on (``SummaryWriter(purge_step=)``).

        Returns:
            The number of lines superseded (0 on every rank but 0).
        """
        if not self.enabled:
            return 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        moved = self._supersede(self.run_dir / METRICS, int(iteration))
        self._jsonl = open(self.run_dir / METRICS, "a", buffering=1, encoding="utf-8")
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=int(iteration) + 1)
            except ImportError:  # tensorboard is a dependency, but a run must not die for a log
                self._tb = None
        return moved

    def _supersede(self, path: Path, iteration: int) -> int:
        lines = _lines(path)
        cut = split_at_resume(lines, iteration)
        if cut == len(lines):
            return 0
        with open(self.run_dir / SUPERSEDED, "a", encoding="utf-8") as side:
            for line in lines[cut:]:
                r = _parse(line)
                r = {"unparsed": line} if r is None else r
                side.write(json.dumps({**r, "superseded_by_resume_at": iteration}) + "\n")
            side.flush()
            os.fsync(side.fileno())
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines[:cut]), encoding="utf-8")
        os.replace(tmp, path)
        return len(lines) - cut

    def write_if_missing(self, record: dict) -> bool:
        """Write the step ``record`` unless ``metrics.jsonl`` holds one of its iteration (a
        replaced rank 0 writes the record its dead predecessor may have missed: it died after the
        step's commit point, before its line). True when written (on rank 0)."""
        if not self.enabled or any(r.get("iteration") == record.get("iteration") and "loss" in r
                                   for r in read_metrics(self.run_dir / METRICS)):
            return False
        self.write(record)
        return True

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self._jsonl is None:
            raise RuntimeError("MetricsWriter.write before start(iteration)")
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            step, values = scalars(record)
            for k, v in values.items():
                self._tb.add_scalar(k, v, step)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self.sinks:
            sink.close()


def plot_losses(records: list[dict], path: Path) -> None:
    """Draw train and validation loss against iteration into a PNG (skipped, with a note, where
    matplotlib is not installed: a finished run must not fail for its plot). The trainer passes
    the run's current records (:func:`read_metrics` of its ``metrics.jsonl``): the whole run,
    the iterations before a resume included, each once."""
    try:
        import matplotlib
    except ImportError:
        print(f"[paratron] matplotlib is not installed: no {path}", flush=True)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["iteration"], r["loss"]) for r in records if "loss" in r]
    val = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_log_line(r: dict, total_iters: int) -> str:
    """One console line, Megatron-style."""
    parts = [f"iteration {r['iteration']:6d}/{total_iters}",
             f"consumed tokens {r['consumed_tokens']:,}",
             f"lm loss {r['loss']:.4f}",
             f"lr {r['lr']:.3e}",
             f"grad norm {r['grad_norm']:.3f}"]
    if "aux_loss" in r:
        parts.append(f"aux loss {r['aux_loss']:.4f}")
    if "mtp_loss" in r:
        parts.append(f"mtp loss {r['mtp_loss']:.4f}")
    if "loss_scale" in r:
        parts.append(f"loss scale {r['loss_scale']:.0f}")
    parts += [f"skipped {r['skipped_iterations']}",
              f"tokens/s {r['tokens_per_second']:.0f}",
              f"TFLOP/s/device {r['tflops_per_device']:.3f}",
              f"MFU {100 * r['mfu']:.1f}%",
              f"peak mem {r['peak_memory_mb']:.0f} MB"]
    return " | ".join(parts)


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated bytes on a GPU, or this process's peak resident set on CPU, in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB

