"""``examples/slurm/train.sbatch`` under stub ``srun`` and ``scontrol``: the stub srun starts the
script's one task per node as two "nodes" on this machine (two torchrun agents, ``--nnodes 2``, one
rank each, c10d rendezvous on 127.0.0.1), which train 2 steps into one shared run directory; the
losses in its metrics.jsonl equal a one-process run's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paratron.local_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=16",
    "model.make_vocab_size_divisible_by=16", "train.micro_batch_size=2", "train.global_batch_size=8",
    "train.train_iters=2", "train.eval_interval=0", "train.deterministic=true", "train.seed=7",
    "optimizer.lr=3e-3", "logging.log_interval=1", "logging.tensorboard=false", "data.split=90,10,0",
]

SRUN = '''#!{python}
"""Stub srun: run the command once per node of the job (SLURM_JOB_NUM_NODES), here, in parallel,
with the node's SLURM_NODEID; record the options; fail as soon as one task fails."""
import json, os, subprocess, sys, time
argv = sys.argv[1:]
options = []
while argv and argv[0].startswith("-"):
    options.append(argv.pop(0))
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"srun": options}}) + "\\n")
nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
tasks = [subprocess.Popen(argv, env=dict(os.environ, SLURM_NODEID=str(i), SLURM_PROCID=str(i), SLURM_LOCALID="0"))
         for i in range(nodes)]
while any(t.poll() is None for t in tasks):
    if any(t.poll() not in (None, 0) for t in tasks):  # --kill-on-bad-exit
        for t in tasks:
            t.poll() is None and t.kill()
    time.sleep(0.1)
sys.exit(next((t.returncode for t in tasks if t.returncode), 0))
'''

SCONTROL = '''#!/bin/sh
# Stub scontrol: "scontrol show hostnames LIST" names this machine once per node, the first name a
# second before the others (a reader that stops after the first, such as head -n 1, has gone by then).
[ "$1 $2" = "show hostnames" ] || exit 2
echo "show hostnames $3" >> "$STUB_LOG"
echo 127.0.0.1
sleep 1
for i in $(seq 2 "$SLURM_JOB_NUM_NODES"); do echo 127.0.0.1; done
'''

RECORDER = '''#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"node": os.environ["SLURM_NODEID"], "argv": sys.argv[1:]}}) + "\\n")
'''


def _slurm_env(tmp_path: Path, run_dir: Path, log: Path, paratron: str) -> dict[str, str]:
    """The environment of a 2-node job of one GPU each, with the stubs first on PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("srun", SRUN.format(python=sys.executable)), ("scontrol", SCONTROL),
                       ("record", RECORDER.format(python=sys.executable))):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    return dict(os.environ, PATH=f"{stubs}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(log),
                OMP_NUM_THREADS="1", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node[01-02]",
                SLURM_JOB_ID="4242", GPUS_PER_NODE="1", MASTER_PORT=str(_free_port()), RUN_DIR=str(run_dir),
                PARATRON=paratron)


def test_sbatch_script_runs_one_paratron_train_per_node(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "stub.log"
    env = _slurm_env(tmp_path, run_dir, log, "record")
    r = subprocess.run(["bash", str(SCRIPT), "--config", "x.toml"], env=env, cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert set(calls[0]["srun"]) >= {"--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"}
    port = env["MASTER_PORT"]
    want = ["train", "--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--run-dir", str(run_dir), "--config", "x.toml"]
    assert sorted((c["node"], c["argv"]) for c in calls[1:]) == [
        ("0", want + ["--node-rank", "0"]), ("1", want + ["--node-rank", "1"])]
    assert run_dir.is_dir()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def _train_in_rank(argv):
    from paratron.cli import main

    return main(argv)


@pytest.mark.slow  # six Python processes that import torch: 2-3 min on 2 loaded cores
def test_sbatch_script_trains_on_two_stub_nodes_like_one_process(tmp_path, tiny_corpus):
    run_dir, log = tmp_path / "shared" / "run", tmp_path / "stub.log"
    sets = [a for o in TINY + tiny_corpus for a in ("--set", o)]
    env = _slurm_env(tmp_path, run_dir, log, f"{sys.executable} -m paratron")
    r = subprocess.run(["bash", str(SCRIPT), *sets], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=400)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log"))) \
        if (run_dir / "logs").is_dir() else ""
    assert r.returncode == 0, r.stdout + r.stderr + logs
    assert log.read_text().splitlines()[0] == "show hostnames node[01-02]"
    # One world of two ranks, one per node, each logging into the shared run directory.
    assert sorted(p.name for p in (run_dir / "logs").glob("rank_*.log")) == ["rank_0.log", "rank_1.log"]
    assert {"torchrun.log", "torchrun_node1.log"} <= {p.name for p in (run_dir / "logs").iterdir()}  # not one file
    two_nodes = _losses(run_dir)

    single = tmp_path / "single"
    assert run_ranks(_train_in_rank, 1, ["train", "--run-dir", str(single), *sets], timeout=300) == [0]
    one = _losses(single)
    assert len(one) == len(two_nodes) == 2
    for step, (got, want) in enumerate(zip(two_nodes, one), 1):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: two nodes {got} vs one process {want}"
