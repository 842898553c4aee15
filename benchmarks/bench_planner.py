"""Planner check on this CPU: predicted against measured step time and peak memory, 4 ranks.

Runs ``paratron plan --calibrate``'s measurement, then trains the default model
(configs/default.toml, 5.2 M parameters) for a few steps under each layout below with
``paratron train --nproc-per-node 4`` and the probe plugin (benchmarks/planner_probe.py), and
compares with :func:`paratron.planner.estimate.estimate` for the same layout:

* Spearman rank correlation of predicted and measured step time (the median timed step; the
  calibration takes medians too);
* predicted peak memory per rank (the largest rank) against the measured one (live tensors at
  the start of a step + the allocator's peak during it, the largest rank).

Usage: PYTHONPATH=. python benchmarks/bench_planner.py [--steps 6] [--out /tmp/bench_planner]
Outputs go to --out (outside the repo); the table is printed for benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from paratron.config import to_toml
from paratron.rules import load_config
from paratron.planner.calibrate import calibrate
from paratron.dryrun.plan_command import model_with_vocab
from paratron.planner.estimate import Problem, estimate
from paratron.planner.hardware import Cluster, device
from paratron.planner.layout import Layout, to_config
from paratron.planner.pipeline import ScheduleCache
from paratron.planner.shape import Shape

REPO = Path(__file__).resolve().parent.parent
GBS = 16
LAYOUTS = [  # tp, pp, vpp, dp, cp, ep, zero, schedule, mbs, recompute, sp
    Layout(1, 1, 1, 4, 1, 1, 0, "1f1b", 4, "none", False),
    Layout(1, 1, 1, 4, 1, 1, 0, "1f1b", 1, "none", False),
    Layout(2, 1, 1, 2, 1, 1, 1, "1f1b", 4, "none", True),
    Layout(2, 2, 1, 1, 1, 1, 0, "1f1b", 4, "none", True),
    Layout(1, 2, 1, 2, 1, 1, 0, "1f1b", 2, "full", False),
    Layout(1, 4, 1, 1, 1, 1, 0, "gpipe", 4, "none", False),
    Layout(1, 4, 1, 1, 1, 1, 0, "1f1b", 1, "none", False),
    Layout(4, 1, 1, 1, 1, 1, 0, "1f1b", 2, "selective", False),
    Layout(1, 2, 2, 2, 1, 1, 0, "interleaved", 2, "none", False),
]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (ties get their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def measure(base, lay: Layout, steps: int, out: Path, seq: int) -> tuple[float, float]:
    """(median step seconds, peak bytes of the largest rank) of a short run of ``lay``."""
    name = lay.short().replace(" ", "_")
    cfg = to_config(base, lay, GBS, seq, "fp32")
    cfg.train.train_iters, cfg.train.eval_interval = steps, 10**6
    cfg.checkpoint.save, cfg.train.sample_prompt = None, None
    cfg.optimizer.lr_warmup_iters = 0
    cfg.train.callbacks = [f"{REPO / 'benchmarks' / 'planner_probe.py'}:PlannerProbe"]
    cfg.logging.tensorboard, cfg.logging.progress = False, False
    path = out / f"{name}.toml"
    path.write_text(to_toml(cfg))
    env = dict(os.environ, PLANNER_PROBE_OUT=str(out / name), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "paratron", "train", "--config", str(path), "--nproc-per-node", "4",
                    "--run-dir", str(out / name)], check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    ranks = [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(4)]
    # The median timed step (the slowest rank's time in each), as the calibration takes medians.
    step = statistics.median(max(r["step_times"][i] for r in ranks) for i in range(1, len(ranks[0]["step_times"])))
    return step, max(r["peak_bytes"] for r in ranks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="/tmp/bench_planner")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    cal = calibrate(4)
    print("calibration:", json.dumps(cal))
    base = load_config(REPO / "configs" / "default.toml")
    model = model_with_vocab(base)
    seq = base.model.seq_length
    prob = Problem(model, Shape.of(model, seq), Cluster(1, 4, device("cpu", calibration=cal)), GBS, seq)
    cache = ScheduleCache()
    rows = []
    for lay in LAYOUTS:
        est = estimate(prob, lay, cache)
        step, peak = measure(base, lay, args.steps, out, seq)
        rows.append((lay, est.step_time, step, est.memory.total, peak))
        print(f"{lay.short():<40} predicted {est.step_time:7.3f} s measured {step:7.3f} s | memory predicted "
              f"{est.memory.total / 1e6:7.1f} MB measured {peak / 1e6:7.1f} MB ({est.memory.total / peak - 1:+.1%})",
              flush=True)
    rho = spearman([r[1] for r in rows], [r[2] for r in rows])
    worst = max(abs(r[3] / r[4] - 1) for r in rows)
    print(f"\nSpearman rho (step time) = {rho:.3f}; worst memory error = {worst:.1%}")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    (out / "result.json").write_text(json.dumps({"rho": rho, "worst_memory_error": worst, "rows": [
        [r[0].short(), r[1], r[2], r[3], r[4]] for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
