"""Running torchrun for ``paratron train --nproc-per-node N``: no orphans, one summary on failure.

* torchrun's agent runs in its own session with ``PR_SET_PDEATHSIG=SIGKILL`` (set between fork
  and exec), and each rank sets the same towards the agent (:mod:`paratron.launch.rankproc`):
  whatever ends the launcher (SIGKILL included) ends the agent, and the agent's end ends the
  ranks. SIGTERM, SIGINT and SIGHUP to the launcher go to the ranks only: they finish the step,
  save and exit 0 (signalled itself, the agent would stop them after a grace period).
* The ranks write everything to ``RUN_DIR/logs/rank_N.log`` (rank 0's progress lines also reach
  the terminal); torchrun's own messages go to ``RUN_DIR/logs/torchrun.log`` (node I > 0 of a
  multi-node job: ``torchrun_nodeI.log``, as the nodes may share the run directory).
* While the job runs, the launcher watches the ranks' processes (their pids come from
  ``logs/rank_N.status.json``) and notes when each disappears. When torchrun exits non-zero it
  prints one diagnosis: the hang report (:mod:`paratron.launch.hang`) when a watchdog fired,
  else the first failure (:mod:`paratron.launch.failures`); then any rank process still alive
  is killed, so none outlives the launcher.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from paratron.launch.failures import collect, read_records, summarize, torchrun_exit_codes
from paratron.launch.hang import diagnose, load_dumps, load_rings
from paratron.launch.startup import LAUNCH_ENV
from paratron.launch.mode import LOG_DIR_ENV
from paratron.launch.rankproc import PR_SET_PDEATHSIG
from paratron.plugins.failslow_escalate import RESTART_FILE, read_restart_request

POLL_S = 0.1


def _agent_dies_with_us() -> None:  # runs in the child between fork and exec
    import ctypes

    os.setsid()
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def prepare_run_dir(run_dir: Path) -> Path:
    """Create ``RUN_DIR/logs`` and clear the previous job's records, hang dumps and restart record."""
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for p in list(log_dir.glob("rank_*.error.json")) + list(log_dir.glob("rank_*.status.json")):
        p.unlink(missing_ok=True)
    shutil.rmtree(run_dir / "hang", ignore_errors=True)
    (run_dir / RESTART_FILE).unlink(missing_ok=True)  # a level-4 record counts for the job that wrote it
    return log_dir


class RankWatch:
    """The local ranks' pids (from their status records) and when each was seen gone."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.pids: dict[int, int] = {}
        self.deaths: dict[int, float] = {}

    def update(self) -> None:
        host = os.uname().nodename
        if not self.pids or len(self.pids) < len(list(self.log_dir.glob("rank_*.status.json"))):
            for r, rec in read_records(self.log_dir, "status").items():
                if rec.get("host") == host:
                    self.pids.setdefault(r, int(rec["pid"]))
        now = time.time()
        for r, pid in self.pids.items():
            if r not in self.deaths and not alive(pid):
                self.deaths[r] = now

    def kill_leftovers(self, wait_s: float = 2.0) -> list[int]:
        """SIGKILL every local rank process still alive after ``wait_s`` (the parent-death
        signal normally ends them within milliseconds of the agent); returns their ranks."""
        deadline = time.time() + wait_s
        while any(alive(pid) for pid in self.pids.values()) and time.time() < deadline:
            time.sleep(POLL_S)
        left = [r for r, pid in self.pids.items() if alive(pid)]
        for r in left:
            try:
                os.kill(self.pids[r], signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


def torchrun_log(log_dir: Path, node_rank: int = 0) -> Path:
    """Where this node's torchrun agent writes its messages (module docstring)."""
    return log_dir / ("torchrun.log" if node_rank == 0 else f"torchrun_node{node_rank}.log")


def run_torchrun(cmd: list[str], run_dir: Path | None = None, node_rank: int = 0) -> int:
    """Run torchrun; with ``run_dir``, log the ranks there and summarise a failure (see module doc)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; keep it without its warning
    log_dir = stderr = None
    if run_dir is not None:
        log_dir = prepare_run_dir(Path(run_dir)).resolve()
        env[LOG_DIR_ENV] = str(log_dir)
        stderr = open(torchrun_log(log_dir, node_rank), "wb")  # this job's messages only
    try:
        env[LAUNCH_ENV] = repr(time.time())  # the start-up breakdown's "spawn" starts here
        proc = subprocess.Popen(cmd, env=env, stderr=stderr, preexec_fn=_agent_dies_with_us)
    finally:
        if stderr is not None:
            stderr.close()
    watch = RankWatch(log_dir) if log_dir is not None else None

    def forward(signum, frame):
        for child in children(proc.pid):
            try:
                os.kill(child, signal.SIGTERM)
            except ProcessLookupError:
                pass

    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in handled}
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            if watch is not None:
                watch.update()
        rc = proc.returncode
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if proc.poll() is None:  # only on an exception in this loop: take the job down with us
            proc.kill()
    if watch is None:
        return rc
    watch.update()
    left = watch.kill_leftovers()
    if rc != 0:
        for line in failure_report(Path(run_dir), log_dir, watch, rc, left, node_rank):
            print(line, file=sys.stderr)
    return 128 - rc if rc < 0 else rc  # killed by a signal: the shell's convention


def failure_report(run_dir: Path, log_dir: Path, watch: RankWatch, rc: int, left: list[int],
                   node_rank: int = 0) -> list[str]:
    """The lines printed after a failed job: the hang diagnosis or the first failure."""
    record = read_restart_request(run_dir)
    if rc > 0 and record is not None:  # a planned exit: the ranks' codes after the first are torchrun's stop
        return [f"paratron train: the job saved and stopped for a restart (fail-slow level 4: rank "
                f"{record['slow_rank']} on {record['host']} stays slow; {run_dir / RESTART_FILE})"]
    lines = []
    if rc < 0:
        lines.append(f"paratron train: the torchrun agent died by {signal.Signals(-rc).name}; "
                     "its ranks were ended with it")
    dumps = load_dumps(run_dir / "hang")
    hang = diagnose(dumps, where=str(run_dir / "hang"), rings=load_rings(run_dir / "hang", dumps))
    if hang is not None:
        lines.append("paratron train: " + hang)
        lines.append(f"  full output of each rank: {log_dir}/rank_N.log")
    elif rc > 0 or read_records(log_dir, "error"):
        try:
            codes = torchrun_exit_codes(torchrun_log(log_dir, node_rank).read_text(errors="replace")[-200_000:])
        except OSError:
            codes = {}
        body = summarize(collect(log_dir, watch.deaths, codes), log_dir)
        lines += ["paratron train: " + body[0]] + body[1:]
    if left:
        lines.append(f"  killed rank process(es) still alive after torchrun ended: {left}")
    lines.append(f"paratron train: failed (exit code {rc})")
    return lines
