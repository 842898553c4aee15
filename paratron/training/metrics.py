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


class MetricsWriter:
    """Writes records to ``RUN_DIR/metrics.jsonl`` and TensorBoard (rank 0 only).

    Training records carry ``iteration, loss, grad_norm, lr, tokens_per_second`` (and more);
    validation records carry ``iteration, val_loss, val_ppl``. These names are a public interface.
    ``sinks``: more writers (``write(record)``, ``close()``) given every record, e.g.
    :class:`~paratron.training.wandb_log.WandbWriter`.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, sinks: list | None = None):
        self.enabled = enabled
        self.sinks = list(sinks or []) if enabled else []
        self.records: list[dict] = []
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:  # tensorboard is a dependency, but a run must not die for a log
                self._tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.records.append(record)
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
    matplotlib is not installed: a finished run must not fail for its plot)."""
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

