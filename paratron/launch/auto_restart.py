"""``paratron train --auto-restart N``: restart a job that asked for it (Greyhound's level 4).

A job whose fail-slow plugin decided that a slow rank costs more than a restart saves a
checkpoint, leaves ``RUN_DIR/restart_request.json`` and exits with code 75
(:mod:`paratron.plugins.failslow_escalate`). The launcher then runs torchrun again, up to N
times, with ``--set checkpoint.load=<the checkpoint.save the record names>``, so the job resumes
from the step it saved. Each restart gets ``PARATRON_RESTART_ATTEMPT=k`` in its environment.

Excluding the slow node: with several nodes (``--nnodes K``, one launcher per node, c10d
rendezvous, which numbers the nodes itself), the launcher on the host the record names does not
rejoin; the others restart with ``--nnodes K-1``. The node that hosts the rendezvous endpoint
cannot leave (its agent holds the store), so the restart then keeps every node and says so.
Without the record (any other failure), nothing is restarted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from paratron.plugins.failslow_escalate import (EXIT_FAILSLOW_RESTART, RESTART_FILE, read_restart_request,
                                                this_host)

ATTEMPT_ENV = "PARATRON_RESTART_ATTEMPT"
"""The restart count (1, 2, ...) in the environment of a restarted job's ranks."""


def restart_command(cmd: list[str], record: dict, host: str, endpoint_host: str | None) -> list[str] | None:
    """The torchrun command of the next attempt after ``record``, on the node named ``host``;
    None when this node is the one to leave out.

    ``cmd`` is this launcher's torchrun command (its ``--nnodes=K`` is lowered by one on the
    nodes that stay, when the slow host is one of several and not the rendezvous host).
    """
    nnodes = next((a.split("=", 1)[1] for a in cmd if a.startswith("--nnodes=")), "1")
    excluded = nnodes.isdigit() and int(nnodes) > 1 and record.get("host") != endpoint_host
    if excluded and record.get("host") == host:
        return None
    out = [f"--nnodes={int(nnodes) - 1}" if excluded and a.startswith("--nnodes=") else a for a in cmd]
    if record.get("checkpoint"):
        out += ["--set", f"checkpoint.load={record['checkpoint']}"]
    return out


def run_with_restarts(cmd: list[str], run_dir: Path, node_rank: int, restarts: int, endpoint: str | None,
                      run_torchrun) -> int:
    """Run ``run_torchrun(cmd, run_dir, node_rank)``; while it leaves a restart record and
    ``restarts`` remain, run it again (:func:`restart_command`). Returns the last exit code,
    :data:`EXIT_FAILSLOW_RESTART` when the job still asks for a restart at the end."""
    env_before = os.environ.get(ATTEMPT_ENV)
    endpoint_host = endpoint.rsplit(":", 1)[0] if endpoint else None
    try:
        for attempt in range(restarts + 1):
            (Path(run_dir) / RESTART_FILE).unlink(missing_ok=True)  # only this attempt's record counts
            if attempt:
                os.environ[ATTEMPT_ENV] = str(attempt)
            rc = run_torchrun(cmd, run_dir, node_rank)
            record = read_restart_request(run_dir)
            if rc == 0 or record is None:
                return rc
            if attempt == restarts:
                print(f"paratron train: the job asks for a restart (rank {record['slow_rank']} on "
                      f"{record['host']} stays slow) but --auto-restart {restarts} are used up; exit "
                      f"code {EXIT_FAILSLOW_RESTART}", file=sys.stderr)
                return EXIT_FAILSLOW_RESTART
            cmd = restart_command(cmd, record, this_host(), endpoint_host)
            if cmd is None:
                print(f"paratron train: this node ({record['host']}) holds the slow rank "
                      f"{record['slow_rank']}: it leaves the job; the other nodes restart without it",
                      file=sys.stderr)
                return EXIT_FAILSLOW_RESTART
            print(f"paratron train: restart {attempt + 1} of {restarts} after the fail-slow exit at iteration "
                  f"{record['iteration']} (rank {record['slow_rank']} on {record['host']}; predicted "
                  f"{record['predicted_gain_s']:.1f} s gained against {record['restart_cost_s']:.1f} s), "
                  f"resuming from {record.get('checkpoint')}", file=sys.stderr)
        return rc
    finally:
        if env_before is None:
            os.environ.pop(ATTEMPT_ENV, None)
        else:
            os.environ[ATTEMPT_ENV] = env_before
