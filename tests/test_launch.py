"""Launcher: a 2-node torchrun job on one machine (rendezvous on 127.0.0.1) forms one world."""

import json
import os
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_launch_joins_one_world(tmp_path):
    port = _free_port()
    out = tmp_path / "world.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmds = [[sys.executable, "-m", "paratron", "info", "--nproc-per-node", "2", "--nnodes", "2",
             "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--set", "parallel.tensor=2", "--output", str(out)] for node in (0, 1)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(logs)
    world = json.loads(out.read_text())
    assert world["world_size"] == 4
    assert sorted(r["rank"] for r in world["ranks"]) == [0, 1, 2, 3]
    nodes = {}
    for r in world["ranks"]:
        nodes.setdefault(r["node"], []).append(r["rank"])
    assert sorted(nodes) == [0, 1] and all(len(v) == 2 for v in nodes.values())
    assert world["groups"]["tp"] == [[0, 1], [2, 3]]
