"""Hangs, crashes and orphans, end to end through ``paratron train --nproc-per-node``, plus the
flight recorder, the hang diagnosis and the run lock on their own.

Faults come from ``tests/faults.py`` (a training-loop plugin driven by ``PARATRON_TEST_FAULT``).
Every end-to-end test checks the process tree afterwards: no process whose command line names
the test's run directory may be left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratron.parallel.flight import FlightRecorder
from paratron.launch.hang import diagnose
from paratron.launch.launch import children
from paratron.launch.runlock import RunLock, RunLocked

ROOT = Path(__file__).resolve().parents[1]

CONFIG = [  # one tiny 4-rank job (tp=2 x dp=2), reused by every test
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.seq_length=16", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_iters=6", "train.eval_interval=0",
    "train.deterministic=true", "optimizer.lr_warmup_iters=1", "logging.log_interval=100",
    "logging.tensorboard=false", "parallel.tensor=2", "parallel.hang_timeout_s=5",
    f"train.callbacks={ROOT / 'tests' / 'faults.py'}:Fault", "data.split=90,10,0",
]


def _command(run_dir: Path, data: list[str], extra: list[str] = (), nproc: int = 4) -> list[str]:
    cmd = [sys.executable, "-m", "paratron", "train", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir)]
    for o in CONFIG + data + list(extra):
        cmd += ["--set", o]
    return cmd


def _env(fault: str = "none:-1:-1") -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PARATRON_TEST_FAULT=fault,
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _processes_naming(text: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains ``text``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text in cmdline and state != "Z":
            out.append(int(d.name))
    return out


def _no_process_left(run_dir: Path) -> None:
    deadline = time.time() + 10
    while _processes_naming(str(run_dir)) and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_naming(str(run_dir)) == [], "rank or agent processes outlived the job"


def _run_fault(tmp_path, data, fault: str):
    run_dir = tmp_path / "run"
    r = subprocess.run(_command(run_dir, data), env=_env(fault), capture_output=True, text=True,
                       timeout=240, cwd=ROOT)
    ended = time.time()
    _no_process_left(run_dir)
    return r, run_dir, ended


# ---- units -------------------------------------------------------------------------------------
def test_flight_recorder_ring_counts_and_completion():
    fr = FlightRecorder(capacity=3)
    t = torch.zeros(2, 3)
    for _ in range(4):
        fr.finish(fr.begin("all_reduce", "tp", (0, 1), t))
    fr.step = 2

    class Work:
        done = False

        def is_completed(self):
            return self.done

    w = Work()
    fr.finish(fr.begin("all_gather", "dp", (0, 2), t), w)
    assert [e.seq for e in fr.entries()] == [3, 4, 1] and fr.counts == {(0, 1): 4, (0, 2): 1}
    assert [e.op for e in fr.pending()] == ["all_gather"]
    fr.poll()
    assert fr.pending() and fr.pending()[0].step == 2
    w.done = True
    fr.poll()
    assert fr.pending() == []
    snap = fr.snapshot()
    assert snap["counts"] == {"0,1": 4, "0,2": 1} and snap["entries"][-1]["shape"] == [2, 3]


def _dump(rank, counts, entries, reason="peer-hang", at=100.0):
    return {"rank": rank, "reason": reason, "time": at, "hang_timeout_s": 5, "counts": counts,
            "entries": entries}


def _op(op, group, ranks, seq, step, start, end=None):
    return {"op": op, "group": group, "ranks": ranks, "seq": seq, "step": step, "shape": [1],
            "dtype": "float32", "start": start, "end": end}


def test_diagnosis_names_the_rank_that_never_entered():
    # Rank 1 skipped world all_reduce #6 of step 3 and waits at step 4 in dp #10 (ranks 1,3);
    # ranks 0, 2, 3 wait in world #6. Rank 1 started waiting first, yet step order decides.
    world = [0, 1, 2, 3]
    waiting = [_op("all_reduce", "world", world, 5, 3, 80, 81), _op("all_reduce", "world", world, 6, 3, 90)]
    dumps = {r: _dump(r, {"0,1,2,3": 6, "1,3": 9, "0,2": 9}, waiting) for r in (0, 2, 3)}
    dumps[0]["reason"] = "hang"
    dumps[1] = _dump(1, {"0,1,2,3": 5, "1,3": 10}, [_op("all_reduce", "world", world, 5, 3, 80, 81),
                                                     _op("all_reduce", "dp", [1, 3], 10, 4, 85)])
    text = diagnose(dumps, where="R/hang")
    first = text.splitlines()[0]
    assert "rank 1 never entered all_reduce #6 of group world (ranks 0,1,2,3) at step 3" in first
    assert "ranks 0, 2, 3 waited in it" in first
    assert "last completed in that group: all_reduce #5" in text and "blocked in all_reduce #10 of group dp" in text
    assert diagnose({r: dict(d, reason="signal") for r, d in dumps.items()}) is None


def test_run_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    with RunLock(tmp_path / "run"):
        with pytest.raises(RunLocked, match=f"pid {os.getpid()} on host"):
            RunLock(tmp_path / "run").acquire()
    # A holder that dies without releasing: its lock is stale and is taken over.
    code = ("import sys, os; sys.path.insert(0, sys.argv[2]); from paratron.launch.runlock import RunLock; "
            "RunLock(sys.argv[1]).acquire(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "dead"), str(ROOT)], check=True)
    lock = RunLock(tmp_path / "dead").acquire()
    assert lock.stale is not None and lock.stale["pid"] != os.getpid()
    lock.release()


# ---- end to end --------------------------------------------------------------------------------
def test_second_job_into_a_locked_run_dir_is_refused(tiny_corpus, tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir):  # this process stands for a live job holding the directory
        r = subprocess.run(_command(run_dir, tiny_corpus), env=_env(), capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "refused" in r.stderr and f"pid {os.getpid()}" in r.stderr
    assert not (run_dir / "logs").exists()  # nothing was launched


def test_hang_names_the_rank_the_op_and_the_group(tiny_corpus, tmp_path):
    r, run_dir, ended = _run_fault(tmp_path, tiny_corpus, "skip:1:3")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "hang: rank 1 never entered host_all_reduce" in out and "of group world (ranks 0,1,2,3) at step 3" in out
    dumps = sorted(p.name for p in (run_dir / "hang").glob("rank_*.json"))
    assert dumps == [f"rank_{i}.json" for i in range(4)]
    hung = json.loads((run_dir / "hang" / "rank_0.json").read_text())
    assert hung["entries"] and {"seq", "op", "group", "shape", "dtype", "start", "end"} <= set(hung["entries"][0])
    # The ranks' watchdogs fired 5 s after the skipped op; 30 s is the bound the issue asks for.
    start = min(e["start"] for d in dumps for e in json.loads((run_dir / "hang" / d).read_text())["entries"]
                if e["end"] is None)
    assert ended - start < 30, f"the job took {ended - start:.1f} s to end after the hang began"


@pytest.mark.parametrize("fault,rank", [("raise:2:3", 2),
                                        pytest.param("kill:2:3", 2, marks=pytest.mark.slow),
                                        pytest.param("raise:1:2", 1, marks=pytest.mark.slow),
                                        pytest.param("kill:1:2", 1, marks=pytest.mark.slow)])
def test_failed_rank_is_named_first_in_a_short_summary(tiny_corpus, tmp_path, fault, rank):
    r, run_dir, ended = _run_fault(tmp_path, tiny_corpus, fault)
    out = (r.stdout + r.stderr).strip().splitlines()
    assert r.returncode != 0
    assert len(out) <= 15, "\n".join(out)
    summary = [line for line in out if line.startswith("paratron train: rank")]
    assert summary and summary[0].startswith(f"paratron train: rank {rank} failed first"), "\n".join(out)
    if fault.startswith("raise"):
        assert f"RuntimeError: injected failure on rank {rank}" in summary[0]
        assert any("tests/faults.py:" in line for line in out)
        assert "Traceback" in (run_dir / "logs" / f"rank_{rank}.log").read_text()
    else:
        assert "SIGKILL" in summary[0]
    assert "Traceback" not in "\n".join(out)


@pytest.mark.parametrize("victim", ["launcher", pytest.param("agent", marks=pytest.mark.slow)])
def test_killing_the_launcher_or_agent_leaves_no_rank(tiny_corpus, tmp_path, victim):
    run_dir = tmp_path / "run"
    p = subprocess.Popen(_command(run_dir, tiny_corpus, ["train.train_iters=100000"], nproc=2),
                         env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.time() + 180
        while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.3)
        assert metrics.exists(), "training never started"
        ranks = _processes_naming(f"--run-dir {run_dir}")
        assert len(ranks) == 4  # launcher, agent, 2 ranks
        target = p.pid if victim == "launcher" else children(p.pid)[0]
        os.kill(target, signal.SIGKILL)
        _no_process_left(run_dir)  # within 10 s
    finally:
        for pid in _processes_naming(str(run_dir)):
            os.kill(pid, signal.SIGKILL)
        p.wait(timeout=30)
    if victim == "agent":
        assert p.returncode != 0 and "torchrun agent died by SIGKILL" in p.stderr.read()


def _p2p_and_collective_entries():
    from paratron.parallel.context import ParallelContext

    ctx = ParallelContext.build(pp=2)
    fr = FlightRecorder()
    ctx.ledger.flight = fr
    t = torch.ones(3)
    peer = 1 - ctx.pp.rank
    op = ctx.pp.p2p_op("send" if ctx.pp.rank == 0 else "recv", t, peer)
    works = ctx.pp.batch_isend_irecv([op])
    opened = [e.end is None for e in fr.entries()]
    for w in works:
        w.wait()
    ctx.world.all_reduce(t)
    fr.poll()
    return opened, [(e.op, e.group, e.seq, e.end is not None) for e in fr.entries()]


def test_flight_recorder_sees_p2p_and_collectives():
    from paratron.local_ranks import run_ranks

    res = run_ranks(_p2p_and_collective_entries, 2, timeout=120)
    # pp and world are the same two ranks (one process group), so they share one numbering.
    assert res[0] == ([True], [("send", "pp", 1, True), ("all_reduce", "world", 2, True)])
    assert res[1] == ([True], [("recv", "pp", 1, True), ("all_reduce", "world", 2, True)])


def _compiled_all_reduces(calls: int, record: bool):
    """``calls`` all-reduces of a ``torch.compile``d function over TP=2 (dynamo traces the
    collective, as ``model.compile`` traces the layers'): with ``record``, under the flight
    recorder, each call after the second under ``error_on_recompile``. Returns the graph breaks
    and the recorded ``(seq, closed)`` entries."""
    from torch._dynamo.utils import counters

    from paratron.parallel.context import ParallelContext

    ctx = ParallelContext.build(tp=2)
    fr = ctx.ledger.flight = FlightRecorder() if record else None

    def step(x):
        y = x * 2
        ctx.tp.all_reduce(y)
        return y + 1

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager")
    for i in range(calls):  # the first two settle the groups' own guards (ledger.used)
        with torch._dynamo.config.patch(error_on_recompile=i >= 2):
            assert compiled(torch.ones(3)).tolist() == [5.0] * 3
    entries = [(e.seq, e.end is not None) for e in fr.entries()] if record else []
    return sum(counters["graph_break"].values()), entries


def test_flight_recorder_under_torch_compile_records_every_op_without_recompiles():
    """The recording runs eagerly at a graph break: traced, dynamo guarded on its counters and
    recompiled each op until its limit. With no recorder the compiled graph has no break."""
    from paratron.local_ranks import run_ranks

    for breaks, entries in run_ranks(_compiled_all_reduces, 2, 6, True, timeout=300):
        assert breaks > 0 and entries == [(i, True) for i in range(1, 7)]
    assert run_ranks(_compiled_all_reduces, 2, 3, False, timeout=300) == [(0, [])] * 2


class _Ctx:
    def __init__(self):
        from paratron.parallel.comm import CommLedger

        self.rank, self.ledger = 3, CommLedger()


class _State:
    def __init__(self, run_dir):
        self.ctx, self.run_dir, self.iteration = _Ctx(), run_dir, 0


def test_watchdog_reasons_and_dump(tmp_path):
    from paratron.launch.watchdog import EXIT_HANG, TERM_GRACE_S, HangWatchdog

    codes = []
    wd = HangWatchdog(_State(tmp_path), timeout_s=30, exit_fn=codes.append)
    wd._started = time.time() - 100
    now = time.time()
    e = wd.recorder.begin("all_reduce", "dp", (1, 3), torch.zeros(4))
    e.start = now - TERM_GRACE_S - 2
    assert wd.check(now) is None
    wd._signalled_at = now - 1  # SIGTERM came 1 s ago: the op may still finish
    assert wd.check(now) is None
    wd._signalled_at = now - TERM_GRACE_S - 1  # ... and it is still blocked: end the rank
    assert wd.check(now) == "signal"
    # With 4 s steps a stage may wait in a receive for most of one: the grace is two steps (a
    # fixed 5 s ended such ranks unsaved on the stop they were about to honour) ...
    wd.longest_step_s = 4.0
    assert wd.term_grace_s() == 8.0 and wd.check(now) is None
    wd._signalled_at = e.start = now - 9
    assert wd.check(now) == "signal"
    wd.longest_step_s = 100.0  # ... and never longer than the hang timeout
    assert wd.term_grace_s() == 30
    wd.longest_step_s = 0.0
    wd._signalled_at = None
    e.start = now - 31
    assert wd.check(now) == "hang"
    e.end = now
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "trigger").write_text("{}")
    assert wd.check(now) == "peer-hang"
    wd.poll_s = 0.01
    e.end = None
    wd.fire("hang")
    dump = json.loads((tmp_path / "hang" / "rank_3.json").read_text())
    assert codes == [EXIT_HANG] and dump["reason"] == "hang" and dump["entries"][0]["end"] is None
    assert dump["counts"] == {"1,3": 1}


def test_rank0_prints_the_diagnosis_without_the_launcher(tmp_path, capsys, monkeypatch):
    from paratron.launch.watchdog import HangWatchdog

    monkeypatch.delenv("PARATRON_LOG_DIR", raising=False)
    state = _State(tmp_path)
    state.ctx.rank = 0
    wd = HangWatchdog(state, timeout_s=5, exit_fn=lambda code: None)
    wd.poll_s = 0.01
    wd.recorder.begin("all_reduce", "world", (0, 1), torch.zeros(1))  # rank 1 never enters it
    (tmp_path / "hang").mkdir()
    (tmp_path / "hang" / "rank_1.json").write_text(json.dumps(_dump(1, {}, [])))
    wd.fire("hang")
    assert "hang: rank 1 never entered all_reduce #1 of group world (ranks 0,1)" in capsys.readouterr().err


def test_watchdog_sees_sigterm_while_the_main_thread_is_busy(tmp_path):
    """Two SIGTERMs end the rank through the watchdog thread, whatever the main thread does (a
    rank blocked in a C++ collective never runs its Python handler)."""
    from paratron.training.trainer import StopFlag
    from paratron.launch.watchdog import EXIT_TERM, HangWatchdog

    codes = []
    wd = HangWatchdog(_State(tmp_path), timeout_s=5, exit_fn=codes.append)
    wd.poll_s = 0.01
    with StopFlag() as stop:
        try:
            wd.on_train_start(None)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.time() + 10
            while not codes and time.time() < deadline:
                time.sleep(0.01)
        finally:
            wd.stop()
    assert codes == [EXIT_TERM] and stop.requested


def test_the_stop_grace_counts_steps_after_the_first(tmp_path):
    """The watchdog's longest step (twice it is the grace after a stop signal) leaves the first,
    warm-up step out."""
    from paratron.launch.watchdog import HangWatchdog

    wd = HangWatchdog(_State(tmp_path), timeout_s=30, exit_fn=lambda code: None)
    state = _State(tmp_path)
    for took in (50.0, 3.0):
        wd.on_step_start(state)
        wd._step_started -= took
        wd.on_step_end(state, {}, {})
    assert 3.0 <= wd.longest_step_s < 4.0, wd.longest_step_s
    assert 6.0 <= wd.term_grace_s() < 8.0
