"""Replacing a dead rank without restarting the job (paratron/elastic/replace.py,
paratron/launch/elastic.py; docs/elastic.md, "Replacing a dead rank").

``paratron train --nproc-per-node N`` with ``train.replace_dead_ranks=true``: one rank SIGKILLs
itself at a random step (seeded; the seed, step and delay are printed), a random fraction of a
step after that step starts, so the death lands anywhere in the step. The job must exit 0, the
other ranks' processes must be the ones that started, the final params must be bitwise those of
an uninterrupted run, and metrics.jsonl must hold the time from the death to the next completed
step. Without a DP replica of the dead rank's state (ZeRO-1) the launcher restarts every rank
from the last checkpoint and says so.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from paratron.checkpoint.items import model_items
from paratron.elastic.replace import GENERATION_ENV, REPLACES_ENV
from paratron.launch import elastic
from paratron.local_ranks import run_ranks
from paratron.rules import load_config
from paratron.training.callbacks import Callback

KILL = "PARATRON_TEST_KILL"  # json {"rank", "step", "delay"}: that rank SIGKILLs itself in that step
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

TINY = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.seq_length=16", "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_iters=6",
    "train.eval_interval=0", "train.deterministic=true", "train.seed=11",
    "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=2",
    "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false",
    "train.sample_tokens=0", "parallel.timeout_s=60", "data.split=100,0,0",
    "train.callbacks=test_elastic_deadrank:Probe",
]


class Probe(Callback):
    """Records this process's pid at the start and the end of training (``pids.jsonl``), kills
    itself where ``$PARATRON_TEST_KILL`` says (only the launch's own process of that rank), and at
    the end saves this rank's final params."""

    def __init__(self, state):
        self.kill = json.loads(os.environ.get(KILL, "null"))
        self.original = not os.environ.get(REPLACES_ENV) and int(os.environ.get(GENERATION_ENV) or 0) == 0

    def _pid(self, state, event):
        with open(Path(state.run_dir) / "pids.jsonl", "a") as f:
            f.write(json.dumps({"rank": state.ctx.rank, "pid": os.getpid(), "event": event}) + "\n")

    def on_train_start(self, state):
        self._pid(state, "start")

    def on_step_start(self, state):
        k = self.kill
        if k and self.original and state.ctx.rank == k["rank"] and state.iteration + 1 == k["step"]:
            threading.Timer(k["delay"], self._die, args=(Path(state.run_dir),)).start()

    @staticmethod
    def _die(run_dir):
        (run_dir / "kill_time").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    def on_train_end(self, state):
        self._pid(state, "end")
        params = {k: c[0].tensor.clone() for k, c in
                  model_items(state.chunks, is_first_stage=state.ctx.is_first_stage).items()}
        torch.save(params, Path(state.run_dir) / f"probe_{state.ctx.rank}.pt")


def _train(overrides, run_dir):
    import paratron.launch.runner as runner

    return runner.run_training(load_config(None, overrides), run_dir)


def uninterrupted(run_dir: Path, overrides: list[str], world: int) -> dict:
    """The reference: the same job on forked ranks, nobody killed; the final params by name."""
    assert run_ranks(_train, world, overrides, str(run_dir), timeout=300) == [0] * world
    return final_params(run_dir, world)


def final_params(run_dir: Path, world: int) -> dict:
    """``{(rank, param name): tensor}``: every rank's own copy (a replica's too)."""
    return {(r, k): v for r in range(world) for k, v in torch.load(run_dir / f"probe_{r}.pt").items()}


def launch(run_dir: Path, overrides: list[str], world: int, kill: dict | None, timeout: int = 400):
    """``paratron train --nproc-per-node world`` with ``train.replace_dead_ranks=true``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{TESTS}:{os.environ.get('PYTHONPATH', '')}",
               **{KILL: json.dumps(kill)})
    cmd = [sys.executable, "-m", "paratron", "train", "--nproc-per-node", str(world), "--run-dir", str(run_dir)]
    for o in overrides + ["train.replace_dead_ranks=true"]:
        cmd += ["--set", o]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def pick_kill(world: int) -> dict:
    """A seeded random victim, step (2..5 of 6) and delay into the step (under the shortest step
    seen, so the death lands in that step or its boundary); printed. Not step 6: a death that
    lands after the last step's commit is replaced, but no step follows to time the recovery by
    (no ``rank_replaced`` record)."""
    seed = int(os.environ.get("PARATRON_TEST_SEED") or time.time_ns() % 10_000)
    rnd = random.Random(seed)
    kill = {"rank": rnd.randrange(world), "step": rnd.randint(2, 5), "delay": round(rnd.uniform(0.0, 0.03), 3)}
    print(f"dead-rank test: seed {seed} (PARATRON_TEST_SEED), kill {kill}")
    return kill


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_replaced(tmp_path, tiny_corpus, extra: list[str], world: int) -> None:
    overrides = TINY + tiny_corpus + extra
    reference = uninterrupted(tmp_path / "reference", overrides, world)
    kill = pick_kill(world)
    run_dir = tmp_path / "killed"
    r = launch(run_dir, overrides, world, kill)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (run_dir / "kill_time").exists(), "the victim did not die"  # it was killed, not a clean run
    assert f"rank {kill['rank']} (pid" in r.stderr and "replacing it in place" in r.stderr, r.stderr
    pids = [json.loads(line) for line in (run_dir / "pids.jsonl").read_text().splitlines()]
    first = {}  # the first start of each rank
    for p in pids:
        if p["event"] == "start":
            first.setdefault(p["rank"], p["pid"])
    end = {p["rank"]: p["pid"] for p in pids if p["event"] == "end"}
    assert sorted(end) == list(range(world)), pids
    for rank in range(world):
        if rank == kill["rank"]:
            assert end[rank] != first[rank], f"rank {rank} was killed but kept its pid"
        else:
            assert end[rank] == first[rank], f"survivor rank {rank}: pid {first[rank]} -> {end[rank]} (restarted)"
    got = final_params(run_dir, world)
    assert got.keys() == reference.keys()
    for k in reference:
        assert torch.equal(got[k], reference[k]), f"final param {k} differs from the uninterrupted run"
    rec = [m for m in metrics(run_dir) if m.get("record") == "rank_replaced"]
    assert len(rec) == 1 and rec[0]["dead_rank"] == kill["rank"], rec
    assert rec[0]["regroup_s"] is not None and rec[0]["regroup_s"] >= 0, rec  # was null when rank 0 died
    kill_to_step = rec[0]["step_done_at"] - float((run_dir / "kill_time").read_text())
    print(f"kill to next completed step: {kill_to_step:.2f} s (detected to step {rec[0]['detect_to_step_s']:.2f} s)")
    assert kill_to_step > 0
    losses = [m["iteration"] for m in metrics(run_dir) if "loss" in m]
    assert sorted(set(losses)) == [1, 2, 3, 4, 5, 6], losses


@pytest.mark.timeout(500)
def test_dead_rank_at_dp2_is_replaced_in_place_bitwise(tiny_corpus, tmp_path):
    check_replaced(tmp_path, tiny_corpus, [], world=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dead_rank_at_dp2_pp2_is_replaced_in_place_bitwise(tiny_corpus, tmp_path):
    check_replaced(tmp_path, tiny_corpus, ["parallel.pipeline=2"], world=4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero1_dead_rank_falls_back_to_the_checkpoint_restart(tiny_corpus, tmp_path):
    """ZeRO-1: the dead rank's optimizer shard has no copy; every rank restarts from the last
    checkpoint (saved every 2 steps), and the job still ends with the uninterrupted params."""
    ck = tmp_path / "killed" / "ck"
    overrides = TINY + tiny_corpus + ["parallel.zero=1", f"checkpoint.save={ck}", "checkpoint.interval=2"]
    reference = uninterrupted(tmp_path / "reference", [o.replace(str(ck), str(tmp_path / "ref_ck")) for o in overrides], 2)
    kill = {"rank": 1, "step": 4, "delay": 0.0}
    r = launch(tmp_path / "killed", overrides, 2, kill)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rank 1 (pid" in r.stderr and "its optimizer shard has no copy (parallel.zero=1" in r.stderr, r.stderr
    assert f"restarting every rank from {ck}" in r.stderr, r.stderr
    got = final_params(tmp_path / "killed", 2)
    for k in reference:
        assert torch.equal(got[k], reference[k]), k


def test_plan_for_death_replaces_only_with_a_replica_of_the_whole_state():
    from paratron.elastic.replace import plan_for_death

    assert plan_for_death(load_config(None, []), 2)[0] == "replace"
    assert plan_for_death(load_config(None, ["parallel.pipeline=2"]), 4)[0] == "replace"
    mode, why = plan_for_death(load_config(None, ["parallel.pipeline=2"]), 2)
    assert mode == "restart" and "no DP replica holds its state (data-parallel degree 1)" in why
    for zero in (1, 2, 3):
        mode, why = plan_for_death(load_config(None, [f"parallel.zero={zero}"]), 2)
        assert mode == "restart" and f"optimizer shard has no copy (parallel.zero={zero}" in why


def _voters(world: int):
    """A launcher's store and ``world`` memberships of generation 0 (threads of this process)."""
    from datetime import timedelta

    import torch.distributed as dist

    from paratron.elastic.replace import Membership

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    members = [Membership(dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                        timeout=timedelta(seconds=30)), r, world, 0, 30.0) for r in range(world)]
    return server, members


def _vote_all(members, iteration):
    from paratron.elastic.replace import RankLost

    out = {}

    def one(m):
        try:
            m.vote(iteration)
            out[m.rank] = "commit"
        except RankLost:
            out[m.rank] = "abort"

    threads = [threading.Thread(target=one, args=(m,)) for m in members]
    for t in threads:
        t.start()
    return threads, out


def test_the_commit_vote_is_all_or_nothing():
    """Every voter reads one decision: commit when all voted (even if the failure record comes
    after), abort when a rank died before voting (its failure record ends the wait)."""
    from paratron.elastic.replace import failed_key, failure_record

    server, members = _voters(3)
    threads, out = _vote_all(members, 1)
    for t in threads:
        t.join(10)
    assert out == {0: "commit", 1: "commit", 2: "commit"}
    server.set(failed_key(0), failure_record("replace", 2, 1, 1, "test"))  # rank 2 dies after voting for 1
    threads, out = _vote_all(members[:2], 1)  # a late reader of step 1 (the decision is kept)
    for t in threads:
        t.join(10)
    assert out == {0: "commit", 1: "commit"}
    threads, out = _vote_all(members[:2], 2)  # step 2: rank 2 is dead and never votes
    for t in threads:
        t.join(10)
    assert out == {0: "abort", 1: "abort"}


def _fake_ranks(body: str) -> list[str]:
    """Rank processes that run ``body`` instead of training (the launcher's loop is under test)."""
    return [sys.executable, "-c", body]


_READY = ("import os, signal, sys, time; from torch.distributed import TCPStore; "
          "from paratron.elastic.replace import ready_key; "
          "TCPStore('127.0.0.1', int(os.environ['MASTER_PORT']), is_master=False).set(ready_key(os.getpid()), '1'); ")
"""A fake rank's first statement: it says it has built its trainer, as a real rank does."""


@pytest.mark.timeout(120)
def test_a_rank_dying_during_start_up_restarts_every_rank(tmp_path, capsys):
    """Rank 1 killed before it built its trainer while rank 0 waits (in the first rendezvous, in
    a real job): the launcher used to wait for a survivor to ask for the replacement, and hung
    until the rendezvous timed out. Now it restarts every rank, and the second generation ends."""
    cfg = load_config(None, ["parallel.timeout_s=60"])
    body = ("import os, signal, sys, time\n"
            "if os.environ['PARATRON_GENERATION'] != '0': sys.exit(0)\n"
            "if os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
            + _READY.replace("; ", "\n") + "\ntime.sleep(90)\n")
    launch = elastic.ElasticLaunch(_fake_ranks(body), 2, tmp_path / "run", cfg)
    start = time.monotonic()
    assert launch.run() == 0
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    assert "the job was still starting up" in err, err
    assert "restarting every rank from the start (no checkpoint saved yet) (generation 1)" in err, err
    assert "replacing it in place" not in err, err


@pytest.mark.timeout(120)
def test_both_replicas_dying_restart_the_job_and_then_fail_instead_of_looping(tmp_path, capsys):
    """Both DP2 ranks dead at once: the launcher used to take each for the other's pending death,
    replace neither and loop forever (generation 1,000 and more), ignoring SIGTERM."""
    cfg = load_config(None, ["parallel.timeout_s=60"])
    # Each dies only once both have said they are ready, so the launcher always sees two ranks
    # of a started job die (under load one could otherwise die before the other had started).
    both_ready = ("import os, signal, time; from torch.distributed import TCPStore\n"
                  "s = TCPStore('127.0.0.1', int(os.environ['MASTER_PORT']), is_master=False)\n"
                  "key = 'both_ready_' + os.environ['PARATRON_GENERATION']\n"
                  "s.add(key, 1)\n"
                  "while s.add(key, 0) < 2:\n    time.sleep(0.01)\n"
                  "os.kill(os.getpid(), signal.SIGKILL)\n")
    launch = elastic.ElasticLaunch(_fake_ranks(_READY.replace("; ", "\n") + "\n" + both_ready), 2,
                                   tmp_path / "run", cfg)
    assert launch.run() == 1
    err = capsys.readouterr().err
    assert err.count("restarting every rank from the start") == elastic.MAX_RESTARTS, err
    assert "its replacement has not joined: no survivor is sure to hold their state" in err
    assert f"died again after {elastic.MAX_RESTARTS} restarts" in err and launch.generation < 10


@pytest.mark.timeout(120)
def test_a_stop_signal_ends_the_launch_even_when_the_ranks_die_of_it(tmp_path, capsys):
    """After a forwarded SIGTERM, ranks killed by it are not deaths to replace: the launcher
    returns 128 + 15 once they are gone."""
    cfg = load_config(None, ["parallel.timeout_s=60"])
    launch = elastic.ElasticLaunch(_fake_ranks("import time; time.sleep(90)"), 2, tmp_path / "run", cfg)
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    start = time.monotonic()
    try:
        assert launch.run() == 128 + signal.SIGTERM
    finally:
        timer.cancel()
    assert time.monotonic() - start < 60 and all(p.poll() is not None for p in launch.procs.values())
    err = capsys.readouterr().err
    assert "stopped by SIGTERM" in err and "replacing it" not in err, err


def test_a_peer_dying_in_the_end_of_run_sample_does_not_fail_a_finished_job():
    """A rank killed after the last step and save, while the ranks drew the end-of-run text
    sample, made the survivor's barrier raise, and the finished job exit 1. Under an elastic
    launch the survivor now warns and ends with 0 (the launcher then finishes the job); without
    one the error still propagates."""
    from types import SimpleNamespace

    from paratron.training.trainer import Trainer

    def broken():
        raise RuntimeError("Connection closed by peer")

    me = SimpleNamespace(ctx=SimpleNamespace(rank=1), end_of_run_outputs=broken, membership=object())
    Trainer.report(me)  # no error
    me.membership = None
    with pytest.raises(RuntimeError, match="closed by peer"):
        Trainer.report(me)


@pytest.mark.timeout(120)
def test_a_death_after_the_training_ended_is_not_replaced(tmp_path, capsys):
    """Rank 1 killed after the ranks' training loops ended (in the end-of-run sample, say): the
    launcher used to announce a replacement that never came; now it says the training had ended
    and lets the other ranks finish (exit 0), starting no new process."""
    cfg = load_config(None, ["parallel.timeout_s=60"])
    body = (_READY.replace("; ", "\n") +
            "\nfrom paratron.elastic.replace import TRAINED_KEY\n"
            "TCPStore('127.0.0.1', int(os.environ['MASTER_PORT']), is_master=False).set(TRAINED_KEY, '1')\n"
            "if os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(2)\n")
    launch = elastic.ElasticLaunch(_fake_ranks(body), 2, tmp_path / "run", cfg)
    assert launch.run() == 0
    err = capsys.readouterr().err
    assert "died by SIGKILL after the training had ended" in err and "not replaced" in err, err
    assert "replacing it in place" not in err and "restarting" not in err, err
    assert launch.generation == 0, launch.generation
