"""The hang watchdog: one thread per rank that turns a stuck collective into a diagnosis and an exit.

Built into the training loop as a :class:`~paratron.training.callbacks.Callback` (first in the
list) when ``parallel.hang_timeout_s > 0`` and the world has more than one rank. It:

* attaches a :class:`~paratron.parallel.flight.FlightRecorder` to the comm ledger, so every
  collective and p2p op of the loop is entered in a ring buffer with its step and times;
* wakes every ``poll_s`` seconds (``min(1, timeout/10)``) and, when this rank's oldest open op
  has been pending for longer than ``parallel.hang_timeout_s``, writes the ring buffer to
  ``RUN_DIR/hang/rank_N.json``, writes ``RUN_DIR/hang/trigger`` so that every other rank dumps
  its own buffer too (each watchdog checks for the trigger when it wakes), and ends the process
  with exit code :data:`EXIT_HANG`; the launcher then prints one diagnosis
  (:func:`paratron.launch.hang.diagnose`), or rank 0 does under a bare torchrun;
* keeps the recorder's collectives in a black box, ``RUN_DIR/hang/rank_N.ring``, that outlives
  a rank aborted by gloo (:class:`~paratron.parallel.flight.BlackBox`);
* dumps the ring buffer too when the loop raises
  :class:`~paratron.parallel.collcheck.CollectiveMismatch` (reason ``"mismatch"``), so that the
  diagnosis can compare the ranks' rings; with ``check_collectives`` the recorder makes every
  collective exchange its signature first (``parallel.check_collectives``);
* keeps a rank killable while its main thread is blocked inside a collective: Python runs signal
  handlers only between bytecodes, so a rank stuck in C++ would never see its SIGTERM. The
  watchdog registers a wakeup fd (``signal.set_wakeup_fd``) and learns of SIGTERM/SIGINT even
  then. After one, an op pending for longer than the grace (:meth:`HangWatchdog.term_grace_s`:
  :data:`TERM_GRACE_S`, or twice the longest step so far, the first one aside, when that is
  longer; at most the hang timeout) ends the rank (exit 143); a second signal ends it at once. A rank that is not blocked
  stops after its step as before: with long steps a pipeline stage waits in a receive for most of
  one, and a fixed few seconds would end it, unsaved, on the stop request it was about to honour.

Why not torch's own NCCL watchdog and Flight Recorder: they exist for NCCL only; paratron runs
on gloo too, and its ledger already sees every op.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from paratron.checkpoint.io import write_json_atomic
from paratron.launch.hang import diagnose, load_dumps, load_rings
from paratron.launch.mode import started
from paratron.parallel.collcheck import CollectiveMismatch
from paratron.parallel.flight import BlackBox, FlightRecorder
from paratron.training.callbacks import Callback

EXIT_HANG = 124
"""Exit code of a rank ended by the watchdog because of a hang (its own or a peer's)."""
EXIT_TERM = 143
"""Exit code of a rank ended by the watchdog after SIGTERM/SIGINT while blocked in an op."""
TERM_GRACE_S = 5.0
"""After SIGTERM/SIGINT, seconds an op may stay pending before the rank is ended."""


def hang_dir(run_dir: Path | str) -> Path:
    return Path(run_dir) / "hang"


class HangWatchdog(Callback):
    """See the module docstring. ``exit_fn`` is ``os._exit`` (tests may pass another)."""

    def __init__(self, state, timeout_s: float, capacity: int = 256, exit_fn=os._exit,
                 check_collectives: bool = False) -> None:
        if timeout_s <= 0:
            raise ValueError(f"parallel.hang_timeout_s={timeout_s} must be > 0 for a watchdog")
        self.timeout_s = float(timeout_s)
        self.poll_s = min(1.0, self.timeout_s / 10)
        self.rank = state.ctx.rank
        self.dir = hang_dir(state.run_dir or "runs/latest")
        self.recorder = FlightRecorder(capacity, exhaustive=check_collectives)
        self.exit_fn = exit_fn
        self._ledger = state.ctx.ledger
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pipe: tuple[int, int] | None = None
        self._old_wakeup = -1
        self._signals = 0
        self._signalled_at: float | None = None
        self._started = 0.0
        self._step_started: float | None = None
        self._steps_timed = 0
        self.longest_step_s = 0.0
        self.fired: str | None = None

    # ---- callback hooks (training thread) --------------------------------------------------
    def on_train_start(self, state) -> None:
        self.recorder.box = BlackBox(self.dir / f"rank_{self.rank}.ring", self.recorder.capacity)
        self._ledger.flight = self.recorder
        self._started = time.time()
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._pipe = (r, w)
            self._old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="paratron-hang-watchdog", daemon=True)
        self._thread.start()

    def on_step_start(self, state) -> None:
        self.recorder.step = state.iteration + 1
        self._step_started = time.time()

    def on_step_end(self, state, metrics, timings) -> None:
        self.recorder.close_all()  # the step waited for every op it issued
        if self._step_started is not None and self._steps_timed:  # the first step (warm-up, compile) aside
            self.longest_step_s = max(self.longest_step_s, time.time() - self._step_started)
        self._steps_timed += 1

    def term_grace_s(self) -> float:
        """Seconds an op may stay pending after a SIGTERM/SIGINT before the rank is ended."""
        return min(self.timeout_s, max(TERM_GRACE_S, 2.0 * self.longest_step_s))

    def on_train_end(self, state) -> None:
        self.stop()

    def on_exception(self, state, exc) -> None:
        exc.paratron_step = state.iteration + 1  # for the launcher's failure summary
        self.stop()
        if isinstance(exc, CollectiveMismatch):
            self.dump("mismatch")  # the launcher's diagnosis compares the ranks' rings

    def stop(self) -> None:
        """End the thread, detach the recorder and restore the previous wakeup fd."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self._ledger.flight is self.recorder:
            self._ledger.flight = None
        if self.recorder.box is not None:
            self.recorder.box.close()
            self.recorder.box = None
        if self._pipe is not None:
            if threading.current_thread() is threading.main_thread():
                signal.set_wakeup_fd(self._old_wakeup)
            for fd in self._pipe:
                os.close(fd)
            self._pipe = None

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wait_for_signal()
            if self._stop.is_set():
                return
            reason = self.check(time.time())
            if reason is not None:
                self.fire(reason)
                return

    def _wait_for_signal(self) -> None:
        if self._pipe is None:
            self._stop.wait(self.poll_s)
            return
        ready, _, _ = select.select([self._pipe[0]], [], [], self.poll_s)
        if not ready:
            return
        try:
            data = os.read(self._pipe[0], 64)
        except (BlockingIOError, OSError):
            return
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self._signals += 1
                self._signalled_at = self._signalled_at or time.time()

    def check(self, now: float) -> str | None:
        """The reason to end this rank now, or None: ``"hang"`` (an op pending too long),
        ``"peer-hang"`` (another rank wrote the trigger), ``"signal"`` (blocked after SIGTERM)."""
        self.recorder.poll()
        pending = self.recorder.pending()
        oldest = min((e.start for e in pending), default=None)
        if self._signals >= 2:
            return "signal"
        if oldest is not None and now - oldest > self.timeout_s:
            return "hang"
        if self._signalled_at is not None and oldest is not None and \
                now - max(oldest, self._signalled_at) > self.term_grace_s():
            return "signal"
        trigger = self.dir / "trigger"
        try:
            if trigger.stat().st_mtime >= self._started:
                return "peer-hang"
        except OSError:
            pass
        return None

    def dump(self, reason: str) -> Path:
        """Write this rank's ring buffer to ``RUN_DIR/hang/rank_N.json``; returns the path."""
        snap = self.recorder.snapshot()
        snap.update(rank=self.rank, pid=os.getpid(), host=socket.gethostname(), reason=reason,
                    time=time.time(), hang_timeout_s=self.timeout_s)
        path = self.dir / f"rank_{self.rank}.json"
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, snap)
        return path

    def print_diagnosis(self) -> None:
        """Wait for the peers' dumps, then print the diagnosis to stderr (rank 0, bare torchrun)."""
        time.sleep(min(2.5 * self.poll_s, 2.5))
        dumps = load_dumps(self.dir)
        text = diagnose(dumps, where=str(self.dir), rings=load_rings(self.dir, dumps))
        if text is not None:
            print(f"[paratron] {text}", file=sys.stderr)

    def fire(self, reason: str) -> None:
        """Dump, tell the other ranks (on a hang), and end the process."""
        self.fired = reason
        try:
            path = self.dump(reason)
            if reason == "hang":
                write_json_atomic(self.dir / "trigger", {"rank": self.rank, "time": time.time()})
                time.sleep(min(2.5 * self.poll_s, 2.5))  # let the peers dump theirs
            what = {"hang": f"an op pending for more than parallel.hang_timeout_s={self.timeout_s:g} s",
                    "peer-hang": "another rank reported a hang",
                    "signal": "SIGTERM/SIGINT while blocked in an op"}[reason]
            print(f"[paratron] rank {self.rank}: ending: {what}; ring buffer in {path}", file=sys.stderr)
            if reason != "signal" and self.rank == 0 and not started().under_launcher:
                self.print_diagnosis()  # no paratron launcher to print it (a bare torchrun)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            self.exit_fn(EXIT_TERM if reason == "signal" else EXIT_HANG)
