"""Time to recover from a dead rank: in-place replacement against the restart from the last checkpoint.

One job of ``--ranks`` ranks (DP2 x PP(ranks/2), ``parallel.zero=0``, a checkpoint every
``--interval`` steps) runs under paratron's elastic launcher (:class:`paratron.launch.elastic.ElasticLaunch`,
this process is the launcher). When rank 1 has finished step ``--at`` (its record in
``metrics.jsonl``), a watcher thread here SIGKILLs rank 1's process. Two ways, same job:

* **in place** (``train.replace_dead_ranks=true``): the survivors keep their processes and state,
  a new process takes rank 1 and copies its state from its DP replica, the interrupted step is
  redone (docs/elastic.md, "Replacing a dead rank");
* **restart** (the launcher's restart path, forced with ``replace=False``): every rank is ended
  and the whole job starts again from the last checkpoint (``checkpoint.load``), redoing the
  steps after it.

Measured from the kill (wall clock, this process): ``first_step`` = until the first step record
that was not in ``metrics.jsonl`` (or its superseded file) before the kill; ``back`` = until the
record of step ``at + 1``, the step the kill interrupted (for the restart, after the redone
steps). The watcher polls the files every 10 ms. The losses of both ways are compared bitwise
(both go on from the same state) and the result is printed with each pair. Repeats alternate which way runs first; the load average
is recorded before and after. Outputs go to a temporary directory.

    .venv/bin/python benchmarks/bench_elastic_recover.py [--ranks 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_elastic_relayout import prepare_corpus  # noqa: E402

from paratron.launch.elastic import ElasticLaunch, rank_argv  # noqa: E402
from paratron.rules import load_config  # noqa: E402

MODEL = ["model.num_layers=8", "model.hidden_size=128", "model.num_attention_heads=4", "model.seq_length=64",
         "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16"]
RUN = ["train.micro_batch_size=1", "train.global_batch_size=8", "train.eval_interval=0", "train.deterministic=true",
       "train.seed=3", "train.sample_tokens=0", "optimizer.lr=1e-3", "optimizer.lr_warmup_iters=1",
       "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false", "data.split=100,0,0",
       "parallel.timeout_s=120", "train.replace_dead_ranks=true"]
VICTIM = 1


def step_lines(run_dir: Path) -> list[str]:
    """Every step record line of the run so far (metrics.jsonl and the superseded file)."""
    out = []
    for name in ("metrics.jsonl", "metrics.superseded.jsonl"):
        try:
            out += [line for line in (run_dir / name).read_text().splitlines() if '"loss"' in line]
        except OSError:  # the superseded file exists only after a restart
            continue
    return out


def watch_and_kill(run_dir: Path, at: int, result: dict) -> None:
    """Kill the victim after step ``at``; then stamp the first new step record and step ``at + 1``."""
    status = run_dir / "logs" / f"rank_{VICTIM}.status.json"
    while not any(json.loads(line)["iteration"] >= at for line in step_lines(run_dir)):
        time.sleep(0.01)
    before = set(step_lines(run_dir))
    pid = json.loads(status.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.time()
    result["killed_after"] = max(json.loads(line)["iteration"] for line in before)
    while "back" not in result:
        for line in set(step_lines(run_dir)) - before:
            it = json.loads(line)["iteration"]
            result.setdefault("first_step", time.time() - t_kill)
            if it == result["killed_after"] + 1:
                result["back"] = time.time() - t_kill
        time.sleep(0.01)


def run_once(work: Path, name: str, overrides: list[str], ranks: int, at: int, replace: bool) -> dict:
    run_dir = work / name
    overrides = overrides + [f"checkpoint.save={run_dir / 'ck'}"]
    argv = ["-m", "paratron", "train", "--run-dir", str(run_dir)]
    for o in overrides:
        argv += ["--set", o]
    result: dict = {}
    launch = ElasticLaunch(rank_argv(argv), ranks, run_dir, load_config(None, overrides), replace=replace)
    watcher = threading.Thread(target=watch_and_kill, args=(run_dir, at, result), daemon=True)
    watcher.start()
    t0 = time.time()
    rc = launch.run()
    watcher.join(timeout=5)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    return dict(result, rc=rc, wall=time.time() - t0, losses=[losses[i] for i in sorted(losses)],
                modes=[e["mode"] for e in launch.events])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--interval", type=int, default=4, help="checkpoint.interval")
    p.add_argument("--at", type=int, default=6, help="kill after this step")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="bench_elastic_recover_") as tmp:
        work = Path(tmp)
        data = prepare_corpus(work)
        for ranks in args.ranks:
            overrides = MODEL + RUN + data + [f"parallel.pipeline={ranks // 2}", f"train.train_iters={args.iters}",
                                              f"checkpoint.interval={args.interval}"]
            load_before, rows = os.getloadavg(), []
            for rep in range(args.repeats):
                order = [True, False] if rep % 2 == 0 else [False, True]
                row = {}
                for replace in order:
                    key = "in_place" if replace else "restart"
                    row[key] = run_once(work, f"r{ranks}_{rep}_{key}", overrides, ranks, args.at, replace)
                    print(json.dumps({"ranks": ranks, "repeat": rep, "way": key, **row[key]}), flush=True)
                row["bitwise_equal_losses"] = row["in_place"]["losses"] == row["restart"]["losses"]
                print(json.dumps({"ranks": ranks, "repeat": rep, "bitwise_equal_losses": row["bitwise_equal_losses"]}),
                      flush=True)
                rows.append(row)
            summary = {"ranks": ranks, "load_before": load_before, "load_after": os.getloadavg()}
            for what in ("first_step", "back"):
                ratios = [r["restart"][what] / r["in_place"][what] for r in rows]
                summary[what] = {"in_place_median_s": statistics.median(r["in_place"][what] for r in rows),
                                 "restart_median_s": statistics.median(r["restart"][what] for r in rows),
                                 "restart_over_in_place_median": statistics.median(ratios),
                                 "ratio_min": min(ratios), "ratio_max": max(ratios)}
            print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
