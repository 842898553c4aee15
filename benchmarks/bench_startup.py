"""Start-up wall time at 8 ranks (TP=2 x PP=2 x DP=2), before and after process groups only for the layout, side by side.

Runs ``paratron train --nproc-per-node 8`` of a small model (the default run's Llama-style
h=256, 4 layers, seq 128, on a BPE of part of the bundled corpus) from two checkouts: this one and
a baseline commit checked out with ``git worktree add`` under /tmp (removed at the end). For each,
fresh (one step) and resumed (one step after loading the checkpoint of a one-step run), with the
runs of the two checkouts interleaved so that the machine's load falls on both alike.

Measured: seconds from launching the command to the end of the first step (rank 0 stamps it
from a training callback: this file, loaded by path, so the baseline needs nothing new), and
to the process's exit; plus, where the checkout logs it, the ``startup`` record of
``metrics.jsonl`` (rank 0 / slowest rank per part). Separately, group creation alone:
``ParallelContext.build`` with every group kind (as before) against the kinds the run uses, on 8
forked gloo ranks. Outputs go to /tmp.

    .venv/bin/python benchmarks/bench_startup.py [--baseline 5603077^] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # as a callback inside a run, the run's own checkout is on the path
    sys.path.insert(0, str(ROOT))

from paratron.training.callbacks import Callback  # noqa: E402
STAMP_ENV = "PARATRON_BENCH_FIRST_STEP_STAMP"
MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=8",
         "model.num_query_groups=4", "model.seq_length=128", "model.normalization=rmsnorm",
         "model.position_embedding_type=rope", "model.activation=swiglu", "model.add_bias_linear=false",
         "model.tie_embeddings=true"]
RUN = ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
       "train.micro_batch_size=1", "train.global_batch_size=4", "train.eval_interval=0",
       "train.sample_prompt=none", "optimizer.lr=1e-3", "optimizer.lr_warmup_iters=1",
       "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false"]


class FirstStepStamp(Callback):
    """Rank 0 writes ``time.time()`` at the end of its process's first step to ``$STAMP_ENV``."""

    def __init__(self, state):
        self.done = False

    def on_step_end(self, state, metrics, timings):
        if not self.done and state.ctx.rank == 0 and os.environ.get(STAMP_ENV):
            Path(os.environ[STAMP_ENV]).write_text(repr(time.time()))
        self.done = True


def prepare_corpus(out: Path, docs: int, vocab: int) -> list[str]:
    """A BPE and token files of the first ``docs`` documents of the bundled corpus, under ``out``."""
    corpus = out / "corpus.jsonl"
    corpus.write_text("\n".join((ROOT / "data/shakespeare.jsonl").read_text().splitlines()[:docs]) + "\n")
    subprocess.run([sys.executable, "-m", "paratron", "preprocess", "--input", str(corpus), "--output-prefix",
                    str(out / "corpus"), "--tokenizer-type", "ByteLevelBPE", "--vocab-size", str(vocab),
                    "--workers", "1"], check=True, cwd=ROOT, capture_output=True)
    tok = next(out.glob("corpus*tokenizer.json"))
    return [f"data.data_path={out / 'corpus'}", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={tok}", "data.split=98,2,0"]


def run_once(tree: Path, extra: list[str], work: Path) -> dict:
    """One ``paratron train --nproc-per-node 8`` in ``tree``; the seconds measured (see the module)."""
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix="run-"))
    stamp = run_dir / "first_step_stamp"
    cmd = [sys.executable, "-m", "paratron", "train", "--run-dir", str(run_dir), "--nproc-per-node", "8"]
    for o in MODEL + RUN + extra + [f"train.callbacks={Path(__file__).resolve()}:FirstStepStamp"]:
        cmd += ["--set", o]
    env = {**os.environ, STAMP_ENV: str(stamp), "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    t_exit = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    startup = next((r for r in records if r.get("record") == "startup"), None)
    return {"first_step": float(stamp.read_text()) - t0, "exit": t_exit - t0, "startup": startup}


def side_by_side(trees: dict[str, Path], data: list[str], work: Path, repeats: int) -> dict:
    """Interleaved fresh and resumed runs of every tree; each tree resumes its own checkpoint."""
    ckpts = {}
    for name, tree in trees.items():  # the checkpoint each side resumes (and a warm-up run)
        ckpts[name] = work / f"ckpt-{name}"
        run_once(tree, data + ["train.train_iters=1", f"checkpoint.save={ckpts[name]}"], work)
    out = {name: {"fresh": [], "resumed": []} for name in trees}
    for _ in range(repeats):
        for name, tree in trees.items():
            out[name]["fresh"].append(run_once(tree, data + ["train.train_iters=1", "checkpoint.save=none"], work))
            out[name]["resumed"].append(run_once(tree, data + ["train.train_iters=2", "checkpoint.save=none",
                                                               f"checkpoint.load={ckpts[name]}"], work))
    return out


def _build_context(kinds: tuple[str, ...] | None) -> dict:
    """One rank: seconds of ``ParallelContext.build`` at TP=2 x PP=2 x DP=2 with ``kinds``."""
    import torch.distributed as dist

    from paratron.parallel.context import ParallelContext

    dist.barrier()
    t0 = time.perf_counter()
    ctx = ParallelContext.build(tp=2, pp=2, kinds=kinds)
    return {"seconds": time.perf_counter() - t0, "joined": len(ctx.created_groups)}


def group_creation(repeats: int) -> dict:
    """``ParallelContext.build`` with every kind (what every run did before groups were chosen per layout) against the
    kinds this benchmark's runs use, on 8 forked gloo ranks, interleaved; the slowest rank's
    seconds, median over ``repeats``."""
    import torch

    from paratron.rules import load_config
    from paratron.local_ranks import run_ranks
    from paratron.training.groups import groups_used

    torch.set_num_threads(1)
    used = groups_used(load_config(None, MODEL + RUN))
    times = {"all kinds": [], "used kinds": []}
    joined = {}
    for _ in range(repeats):
        for name, kinds in (("all kinds", None), ("used kinds", used)):
            out = run_ranks(_build_context, 8, kinds, timeout=300)
            times[name].append(max(o["seconds"] for o in out))
            joined[name] = out[0]["joined"]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"seconds_slowest_rank": med, "groups_joined_per_rank": joined, "used_kinds": list(used),
            "ratio": med["used kinds"] / med["all kinds"]}


def summarize(results: dict) -> dict:
    table = {}
    for name, modes in results.items():
        for mode, runs in modes.items():
            row = {"first_step_s": statistics.median(r["first_step"] for r in runs),
                   "exit_s": statistics.median(r["exit"] for r in runs), "runs": len(runs)}
            recs = [r["startup"] for r in runs if r["startup"]]
            if recs:  # per part and per side (rank 0, slowest), the median over the runs
                row["startup_median"] = {
                    part: {side: statistics.median(r["parts"][part][side] for r in recs if part in r["parts"])
                           for side in ("rank0", "slowest")}
                    for part in recs[0]["parts"]} | {"wall": {
                        side: statistics.median(r["wall"][side] for r in recs) for side in ("rank0", "slowest")}}
            table[f"{name}/{mode}"] = row
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="5603077^", help="the commit before the start-up work")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default="/tmp/bench_startup.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_startup-"))
    base = work / "baseline"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        data = prepare_corpus(work, args.docs, args.vocab)
        load_before = os.getloadavg()
        groups = group_creation(args.repeats * 2)
        results = side_by_side({"before": base, "after": ROOT}, data, work, args.repeats)
        table = summarize(results)
        table["group_creation"] = groups
        for mode in ("fresh", "resumed"):
            b, a = table[f"before/{mode}"], table[f"after/{mode}"]
            table[f"ratio/{mode}"] = {"first_step": a["first_step_s"] / b["first_step_s"],
                                      "exit": a["exit_s"] / b["exit_s"]}
        table["load_average"] = {"before_runs": load_before, "after_runs": os.getloadavg()}
        table["baseline"] = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
        Path(args.out).write_text(json.dumps({"summary": table, "runs": results}, indent=1))
        print(json.dumps(table, indent=1))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
