"""The elastic launcher of ``paratron train --nproc-per-node N`` with ``train.replace_dead_ranks``.

Instead of torchrun, the launcher starts the N rank processes itself and serves their store (a
:class:`torch.distributed.TCPStore` in this process, so that it outlives every rank). Each rank
gets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (the store) and
:data:`~paratron.elastic.replace.ELASTIC_ENV`, and dies with the launcher (``PR_SET_PDEATHSIG``,
:mod:`paratron.launch.rankproc`). The launcher watches the processes:

* every rank exits 0: the job is done (exit 0);
* a rank dies by a signal (SIGKILL, an out-of-memory kill...): one decision, printed as one line
  (:func:`~paratron.elastic.replace.plan_for_death`):

  - **replace**: a DP replica holds its state. The launcher writes the failure record of the
    current generation ``g`` (the survivors, their step ended by a failed collective, wait for it)
    and starts a replacement with the same rank in generation ``g + 1``
    (:data:`~paratron.elastic.replace.REPLACES_ENV`); the survivors' processes live on.
  - **restart**: no replica (DP = 1, or ZeRO shards of the optimizer state that only the dead rank
    held). Every rank is ended and the whole job is started again in generation ``g + 1``, with
    ``checkpoint.load`` set to ``checkpoint.save`` when a checkpoint exists there (the restart
    from the last checkpoint), else from the start.

* SIGTERM, SIGINT or SIGHUP to the launcher go to the ranks as SIGTERM (they finish the step, save
  and exit 0, as under torchrun);
* a rank exits non-zero by itself (an exception): the others are ended and the launcher returns
  its exit code after one summary (:mod:`paratron.launch.failures`); nothing is replaced, as the
  same error would come again.

* a rank dies during start-up, before every rank has built its trainer (the others may wait in
  the first rendezvous, at no step a replacement could join): every rank restarts;
* a rank dies after the training has ended (a rank set ``TRAINED_KEY``: its last step and save
  are done): nothing is replaced or restarted, the others finish the job;
* a second rank dies before the first one's replacement has joined (both DP replicas of a stage,
  say): no survivor is sure to hold their state, so every rank restarts (from the last checkpoint
  when there is one); after :data:`MAX_RESTARTS` restarts the job fails rather than loop.
* once the launcher has forwarded a stop signal, no death is replaced: it waits for the ranks
  and returns ``128 + signal`` if any of them did not exit 0.

Limits: one node; one death at a time is replaced (two at once restart the job).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from paratron.elastic.replace import (ELASTIC_ENV, GENERATION_ENV, REPLACES_ENV, TRAINED_KEY, failed_key,
                                      failure_record, lost_key, plan_for_death, ready_key)
from paratron.launch.failures import collect, summarize
from paratron.launch.launch import POLL_S, prepare_run_dir
from paratron.launch.mode import LOG_DIR_ENV
from paratron.launch.startup import LAUNCH_ENV


MAX_RESTARTS = 3
"""Whole-job restarts one launch makes before it fails: a death that comes back at once after
each restart (a broken node, a start-up crash by signal) must end the job, not loop."""


def say(line: str) -> None:
    print(f"paratron train: {line}", file=sys.stderr, flush=True)


class ElasticLaunch:
    """The rank processes of one elastic job and the store they share.

    Args:
        argv: the command each rank runs (``python -m paratron train ...``, without the launch flags).
        world: the number of ranks.
        run_dir: the run directory (its ``logs/`` gets the ranks' logs and records).
        cfg: the validated config (the replace-or-restart decision; ``checkpoint.save``).
        replace: False forces the restart path (the benchmark's baseline).
    """

    def __init__(self, argv: list[str], world: int, run_dir: Path, cfg, replace: bool = True) -> None:
        self.argv, self.world, self.cfg, self.replace = list(argv), world, cfg, replace
        self.log_dir = prepare_run_dir(Path(run_dir)).resolve()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=cfg.parallel.timeout_s))
        self.generation, self.extra = 0, []
        self.pending: int | None = None  # a dead rank whose replacement waits for a survivor to need it
        self.procs: dict[int, subprocess.Popen] = {}
        self.events: list[dict] = []  # one per decision (the benchmark reads them)
        self.restarts = 0
        self.stopping: int | None = None  # the stop signal forwarded to the ranks, once one came

    def spawn(self, rank: int, replaces: bool = False) -> None:
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(self.world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port),
                   **{ELASTIC_ENV: "1", GENERATION_ENV: str(self.generation), LOG_DIR_ENV: str(self.log_dir),
                      LAUNCH_ENV: repr(time.time())})
        env.setdefault("OMP_NUM_THREADS", "1")
        env.pop(REPLACES_ENV, None)
        if replaces:
            env[REPLACES_ENV] = str(rank)
        self.procs[rank] = subprocess.Popen(self.argv + self.extra, env=env)

    def run(self) -> int:
        """Start the ranks and watch them to the end of the job; returns its exit code."""
        for r in range(self.world):
            self.spawn(r)
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
        previous = {s: signal.signal(s, self.forward) for s in handled} if main else {}
        try:
            while True:
                time.sleep(POLL_S)
                codes = {r: p.poll() for r, p in self.procs.items()}
                if all(c == 0 for r, c in codes.items() if r != self.pending):
                    if self.pending is not None and not self.store.check([TRAINED_KEY]):
                        say(f"rank {self.pending} died after the job's last collective: the other ranks "
                            "finished; nothing to redo")
                    return 0
                if self.stopping is not None:  # the ranks were told to stop: deaths are not failures now
                    if all(c is not None for c in codes.values()):
                        return self.stopped(codes)
                    continue
                if self.pending is not None:
                    codes.pop(self.pending)  # the death being handled, not a second one
                    self.maybe_replace(codes)
                dead = next((r for r, c in codes.items() if c is not None and c < 0), None)
                if dead is not None:
                    if self.on_death(dead, -codes[dead]):
                        return self.give_up(dead)
                    continue
                failed = next((r for r, c in codes.items() if c not in (None, 0)), None)
                if failed is not None:
                    return self.fail(failed, codes[failed])
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)
            self.end_all()

    def forward(self, signum, frame) -> None:
        """SIGTERM, SIGINT or SIGHUP to the launcher: the ranks finish the step, save and exit 0."""
        self.stopping = signum
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def on_death(self, rank: int, signum: int) -> bool:
        """One rank died by ``signum``: replace it, or restart every rank (module docstring).
        Returns True when the restarts are used up (the job must fail)."""
        what = f"rank {rank} (pid {self.procs[rank].pid}) died by {signal.Signals(signum).name}"
        if self.store.check([TRAINED_KEY]):  # no step left to redo: the others finish the job
            say(f"{what} after the training had ended (the last step and save done): not replaced; the other "
                "ranks finish the job")
            self.pending = rank
            return False
        mode, why = plan_for_death(self.cfg, self.world)
        if not self.replace:
            mode, why = "restart", "replacement is off for this launch"
        if mode == "replace" and not self.all_ready():
            mode, why = "restart", ("the job was still starting up (not every rank had built its trainer): "
                                    "no survivor is at a step that could take a replacement in")
        if self.pending is not None:
            mode, why = "restart", (f"rank {self.pending} died before it and its replacement has not joined: "
                                    "no survivor is sure to hold their state")
            self.pending = None
        if mode == "restart" and self.restarts >= MAX_RESTARTS:
            return True
        pid = self.procs[rank].pid
        self.store.set(failed_key(self.generation), failure_record(mode, rank, pid, self.generation + 1, why))
        self.events.append({"mode": mode, "rank": rank, "pid": pid, "detected": time.time(),
                            "generation": self.generation + 1})
        self.generation += 1
        if mode == "replace":
            self.pending = rank
            say(f"{what}: {why}; replacing it in place (generation {self.generation}); the other ranks "
                "keep their processes and state")
            return False
        self.restarts += 1
        self.end_all()
        self.extra = self.restart_from()
        source = self.extra[-1].split("=", 1)[1] if self.extra else "the start (no checkpoint saved yet)"
        say(f"{what}: {why}; restarting every rank from {source} (generation {self.generation})")
        for r in range(self.world):
            self.spawn(r)
        return False

    def all_ready(self) -> bool:
        """Every process of the current generation, the dead one included, has built its trainer
        (:func:`~paratron.elastic.replace.ready_key`)."""
        return self.store.check([ready_key(p.pid) for p in self.procs.values()])

    def maybe_replace(self, codes: dict) -> None:
        """Start the pending replacement once a survivor waits to regroup (:func:`lost_key`)."""
        old = self.generation - 1
        if any(self.store.check([lost_key(old, r)]) for r in codes if r != self.pending):
            rank, self.pending = self.pending, None
            self.spawn(rank, replaces=True)
            say(f"rank {rank}: replacement started (pid {self.procs[rank].pid})")

    def restart_from(self) -> list[str]:
        """The overrides of a restart: ``checkpoint.load=<checkpoint.save>`` when it holds one."""
        save = self.cfg.checkpoint.save
        if save and (Path(save) / "latest").exists():
            return ["--set", f"checkpoint.load={save}"]
        return []

    def stopped(self, codes: dict) -> int:
        """Every rank has ended after a forwarded stop signal: 0 if each saved and exited 0."""
        code = 0 if all(c == 0 for c in codes.values()) else 128 + self.stopping
        say(f"stopped by {signal.Signals(self.stopping).name}" + ("" if code == 0 else
            f"; ranks {sorted(r for r, c in codes.items() if c != 0)} did not exit 0 (exit {code})"))
        return code

    def give_up(self, rank: int) -> int:
        self.end_all()
        say(f"rank {rank} died again after {self.restarts} restarts of every rank "
            f"(the most one launch makes, MAX_RESTARTS={MAX_RESTARTS}); failing the job")
        return 1

    def fail(self, rank: int, code: int) -> int:
        self.end_all()
        body = summarize(collect(self.log_dir, {}, {}), self.log_dir)
        say(body[0])
        for line in body[1:]:
            print(line, file=sys.stderr)
        say(f"failed (rank {rank} exited with code {code})")
        return code

    def end_all(self) -> None:
        """SIGKILL every rank process still running and reap them."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()


def rank_argv(launch_argv: list[str]) -> list[str]:
    """What each rank runs: this interpreter on ``launch_argv`` (``-m paratron train ...``)."""
    return [sys.executable] + launch_argv
