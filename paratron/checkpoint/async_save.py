"""Asynchronous saves: copy the tensors off the training buffers, then write in a background thread.

The copy (:meth:`Staging.stage`) is the only part the training loop waits for; it goes into CPU
buffers that are kept between saves (pinned when the source is on a GPU, so the device-to-host
copies run at full bandwidth). The write then runs in a :class:`BackgroundWriter` thread while
training continues; its collectives use a process group of their own, so they never interleave
with the training step's (see ``CheckpointManager``).
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .items import CheckpointError, SavedChunk, StateItems


class Staging:
    """CPU copies of checkpoint chunks, reused from one save to the next while shapes match."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def stage(self, items: StateItems) -> StateItems:
        """Copy every chunk into a CPU buffer; returns the same items pointing at the copies."""
        out: StateItems = {}
        on_gpu = False
        for key, chunks in items.items():
            staged = []
            for c in chunks:
                src = c.tensor
                buf = self._buffers.get((key, c.offsets))
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                    buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
                    self._buffers[(key, c.offsets)] = buf
                buf.copy_(src, non_blocking=src.is_cuda)
                on_gpu |= src.is_cuda
                staged.append(SavedChunk(buf, c.offsets, c.global_shape))
            out[key] = staged
        if on_gpu:
            torch.cuda.synchronize()
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class BackgroundWriter:
    """Runs one write job at a time in a thread; :meth:`wait` joins it and re-raises its error."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """A job was started and not yet waited for."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """A job is still executing."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[], None], name: str) -> None:
        """Start ``job``; the previous one must have been waited for.

        Raises:
            CheckpointError: a job is still running.
        """
        if self._thread is not None:
            raise CheckpointError("an asynchronous checkpoint save is still running; call wait() first")

        def run() -> None:
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - re-raised in wait() on the training thread
                self._error = e

        self._error = None
        # A daemon thread: an exiting trainer that never calls wait() must not hang on it.
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the running job (if any) is done.

        Raises:
            CheckpointError: the job failed (its exception is chained).
        """
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"asynchronous checkpoint save failed: {type(err).__name__}: {err}") from err
