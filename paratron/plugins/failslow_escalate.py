"""Greyhound's levels 3 and 4 (Wu et al., ATC'25, sections 4.3-4.4), as decisions on measured and
simulated step times: when to re-lay out the pipeline online, and when to give up and restart.

Both are ski-rental problems (Karlin et al., "Competitive randomized algorithms for non-uniform
problems", SODA'90): each step at the present layout "rents" (costs its measured step time
minus the predicted step time of the remedy); the remedy is "bought" once (a re-layout, or a
checkpoint and restart) at a cost in seconds. The break-even rule buys when the rent paid so
far reaches the cost, which never pays more than twice the best choice made in hindsight; and
it never buys when the gain over the remaining steps cannot repay the cost.

Nothing here talks to other ranks: :class:`~paratron.plugins.failslow.FailSlow` feeds it
figures every rank holds the same copy of (from its one host all-reduce per step), so every
rank decides the same.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

EXIT_FAILSLOW_RESTART = 75
"""The exit code of a job that checkpointed and stopped so that it is restarted without its
slow rank (level 4; EX_TEMPFAIL of sysexits.h: "try again"). ``paratron train --auto-restart N``
restarts on it (:mod:`paratron.launch.auto_restart`)."""

RESTART_FILE = "restart_request.json"
"""Rank 0 writes it in the run directory before a level-4 exit: the slow rank, its host, the
checkpoint to resume from, and the decision's predicted effect."""


@dataclass
class SkiRental:
    """The break-even rule for one remedy: :meth:`rent` once per step while it would help."""

    paid: float = 0.0  # seconds lost so far at the present layout, against the remedy's prediction

    def rent(self, loss_s: float, cost_s: float, remaining_steps: int) -> bool:
        """Add one step's ``loss_s`` (measured minus predicted step seconds) and say whether to
        buy now: the rent paid reaches ``cost_s`` and ``loss_s`` over the remaining steps
        exceeds it. A step with nothing to gain resets the rent (the slowdown went away)."""
        if loss_s <= 0:
            self.paid = 0.0
            return False
        self.paid += loss_s
        return self.paid >= cost_s and loss_s * remaining_steps > cost_s

    def reset(self) -> None:
        self.paid = 0.0


def moves_back(start: list[int], current: list[int], target: list[int]) -> bool:
    """Whether ``target`` gives layers back to a stage that ``current`` took them off (against
    ``start``). Away from the starting layout, a slow-rank re-layout may only move layers further
    the same way; the one way back is the return to ``start`` once no rank is flagged, so that a
    noisy flag cannot move layers to and fro."""
    return any(t > c and c < s for s, c, t in zip(start, current, target))


def relayout_decision(iteration: int, current: list[int], target: list[int], measured_s: float,
                      predicted_s: float, cost_s: float, cost_measured: bool, paid_s: float,
                      remaining: int, reason: str, model: dict) -> dict:
    """The ``failslow_decision`` record of a level-3 re-layout: the measured and predicted step
    (seconds), the budget, and ``model``, what the prediction came from: ``per_layer_s`` (seconds
    per layer per microbatch of each stage) and ``fixed_s`` (non-layer seconds per microbatch of
    each virtual stage), both measured; ``simulated_now_s`` and ``simulated_then_s``, the
    simulator's step at the present and the target layout; ``proposed_at``, the iteration whose
    ``failslow_layout`` record proposed the target."""
    rounded = {k: [round(x, 6) for x in v] if isinstance(v, list) else (round(v, 6) if isinstance(v, float) else v)
               for k, v in model.items()}
    return {"level": 3, "action": "relayout", "iteration": iteration, "reason": reason, **rounded,
            "from": list(current), "to": list(target), "measured_step_s": round(measured_s, 6),
            "predicted_ratio": round(predicted_s / measured_s, 4), "predicted_step_s": round(predicted_s, 6),
            "predicted_gain_s": round((measured_s - predicted_s) * remaining, 4), "remaining_steps": remaining,
            "relayout_cost_s": round(cost_s, 4), "cost": "measured" if cost_measured else "prior",
            "rent_paid_s": round(paid_s, 4)}


def relayout_effect(decision: dict, measured_s: float, cost_s: float) -> dict:
    """The ``failslow_effect`` record: the measured step after the re-layout against the
    decision's prediction and the step before it, and the re-layout's measured cost."""
    return {"level": 3, "iteration_decided": decision["iteration"], "layout": decision["to"],
            "measured_step_s": round(measured_s, 6), "predicted_step_s": decision["predicted_step_s"],
            "measured_ratio": round(measured_s / decision["measured_step_s"], 4),
            "predicted_ratio": decision["predicted_ratio"],
            "prediction_error": round(measured_s / decision["predicted_step_s"] - 1, 4),
            "relayout_cost_s": round(cost_s, 4)}


def restart_decision(iteration: int, rank: int, host: str, measured_s: float, healthy_s: float,
                     cost_s: float, paid_s: float, remaining: int, checkpoint: str | None) -> dict:
    """The ``failslow_decision`` record of a level-4 restart."""
    return {"level": 4, "action": "restart", "iteration": iteration, "slow_rank": rank, "host": host,
            "measured_step_s": round(measured_s, 6), "predicted_step_s": round(healthy_s, 6),
            "predicted_gain_s": round((measured_s - healthy_s) * remaining, 4), "remaining_steps": remaining,
            "restart_cost_s": round(cost_s, 4), "rent_paid_s": round(paid_s, 4),
            "exit_code": EXIT_FAILSLOW_RESTART, "checkpoint": checkpoint}


def write_restart_request(run_dir: Path, decision: dict) -> Path:
    """Rank 0: write :data:`RESTART_FILE` (atomically) for the launcher's restart loop."""
    path = Path(run_dir) / RESTART_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(decision), encoding="utf-8")
    tmp.replace(path)
    return path


def read_restart_request(run_dir: Path) -> dict | None:
    """The level-4 record a job left in ``run_dir``, or None."""
    path = Path(run_dir) / RESTART_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def this_host() -> str:
    return socket.gethostname()
