"""Online re-layout against checkpoint + restart of the same layout change, side by side.

Each change (``--change``, a name in :data:`CHANGES`; the default ``split`` keeps the pipeline
degree and moves the stage split) is applied after step ``--at`` of a ``paratron train
--nproc-per-node N`` run, two ways:

* **online**: one job; a callback asks for the change after step ``at`` (``state.request_relayout``)
  and the job goes on in memory (docs/elastic.md);
* **restart**: the job saves a checkpoint after step ``at`` and exits; a second job at the new
  layout loads it and goes on (what every layout change cost before).

Measured on rank 0 with wall-clock stamps from a callback (this file, loaded by path):
online = from the end of step ``at`` to the start of step ``at + 1`` (agreement, rebuild, the
point-to-point moves); restart = from the end of step ``at`` to the first job's exit (the save,
the teardown) plus from launching the second job to the start of its first step (interpreter and
torch import, process groups, model build, the load). A plain step boundary of the online run
(the median gap between a step's end and the next step's start, the change's left out) is the
reference of what a boundary costs anyway. The losses after the change must agree bitwise
between the two ways (both train the same steps at the same new layout from the same state).

The repeats alternate which way runs first; ``os.getloadavg()`` is recorded before and after.
Outputs go to a temporary directory.

    .venv/bin/python benchmarks/bench_elastic_relayout.py [--ranks 4 8] [--repeats 3] [--change split]

``--change grow`` changes the pipeline degree (PP2 -> PP4, DP fixed; the online job starts with spares).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # as a callback inside a run, the run's own checkout is on the path
    sys.path.insert(0, str(ROOT))

from paratron.training.callbacks import Callback  # noqa: E402

STAMP_ENV = "PARATRON_BENCH_RELAYOUT_STAMPS"    # rank 0 appends one JSON line per event
REQUEST_ENV = "PARATRON_BENCH_RELAYOUT_REQUEST"  # json {"at": step, "request": {...}} (online only)
MODEL = ["model.num_layers=8", "model.hidden_size=128", "model.num_attention_heads=4", "model.seq_length=64",
         "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16"]
RUN = ["train.micro_batch_size=1", "train.global_batch_size=8", "train.eval_interval=0", "train.deterministic=true",
       "train.seed=3", "train.sample_prompt=none", "train.sample_tokens=0", "optimizer.lr=1e-3",
       "optimizer.lr_warmup_iters=1", "optimizer.clip_grad=0.0", "parallel.zero=1", "logging.log_interval=1",
       "logging.tensorboard=false", "logging.progress=false", "train.elastic_relayout=true"]


@dataclass(frozen=True)
class Change:
    """A layout change under test.

    Attributes:
        start: overrides of the layout the job starts at.
        target: overrides of the layout after the change (the restarted job's).
        request: keyword arguments of ``state.request_relayout`` that ask a running job for it.
        online_extra: overrides of the online job only (a grow's ``train.elastic_spares``).
        start_ranks: the processes of the restart's first job, when not ``ranks`` (a grow
            starts on fewer).
    """

    start: list[str]
    target: list[str]
    request: dict
    online_extra: tuple = ()
    start_ranks: int | None = None


def split_change(ranks: int) -> Change:
    """Same pipeline degree, another stage split: PP2 x DP2 [4,4] -> [3,5] at 4 ranks, PP4 x DP2
    [2,2,2,2] -> [1,3,3,1] at 8."""
    pp, before, after = {4: (2, [4, 4], [3, 5]), 8: (4, [2, 2, 2, 2], [1, 3, 3, 1])}[ranks]
    split = "parallel.pipeline_layout=" + ",".join(map(str, before))
    return Change([f"parallel.pipeline={pp}", split],
                  [f"parallel.pipeline={pp}", "parallel.pipeline_layout=" + ",".join(map(str, after))],
                  {"layout": after})


def grow_change(ranks: int) -> Change:
    """Another pipeline degree, DP fixed: PP2 -> PP4 (2 -> 4 ranks) at 4 ranks, PP2 x DP2 -> PP4
    x DP2 (4 -> 8 ranks) at 8; the online job starts with ``ranks / 2`` spares (docs/elastic.md,
    "Changing the pipeline degree"). ZeRO-0, the setting the figures in benchmarks/README.md were
    measured at (the change takes every ZeRO stage now; tests/test_elastic_regrid.py)."""
    half = ranks // 2
    return Change(["parallel.pipeline=2", "parallel.zero=0"], ["parallel.pipeline=4", "parallel.zero=0"],
                  {"layout": None, "pipeline": 4}, (f"train.elastic_spares={half}",), half)


CHANGES = {"split": split_change, "grow": grow_change}
"""``--change`` name -> the :class:`Change` at a given rank count."""


class Stamps(Callback):
    """Rank 0 appends ``{"event", "iteration", "t"}`` at each step's start and end to
    ``$STAMP_ENV``; every rank asks for ``$REQUEST_ENV``'s change after its step."""

    def __init__(self, state):
        self.path = os.environ.get(STAMP_ENV)
        self.plan = json.loads(os.environ.get(REQUEST_ENV) or "{}")

    def _stamp(self, state, event: str) -> None:
        if self.path and state.ctx.rank == 0:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"event": event, "iteration": state.iteration, "t": time.time()}) + "\n")

    def on_step_start(self, state):
        self._stamp(state, "start")  # state.iteration: steps completed so far

    def on_step_end(self, state, metrics, timings):
        self._stamp(state, "end")
        if self.plan and state.iteration == self.plan["at"]:
            state.request_relayout(**self.plan["request"])


def prepare_corpus(out: Path) -> list[str]:
    """A BPE and token files of part of the bundled corpus, under ``out``."""
    corpus = out / "corpus.jsonl"
    corpus.write_text("\n".join((ROOT / "data/shakespeare.jsonl").read_text().splitlines()[:80]) + "\n")
    subprocess.run([sys.executable, "-m", "paratron", "preprocess", "--input", str(corpus), "--output-prefix",
                    str(out / "corpus"), "--tokenizer-type", "ByteLevelBPE", "--vocab-size", "512",
                    "--workers", "1"], check=True, cwd=ROOT, capture_output=True)
    tok = next(out.glob("corpus*tokenizer.json"))
    return [f"data.data_path={out / 'corpus'}", "data.tokenizer_type=HuggingFaceTokenizer",
            f"data.tokenizer_model={tok}", "data.split=100,0,0"]


def train(ranks: int, overrides: list[str], run_dir: Path, request: dict | None = None) -> dict:
    """One ``paratron train``: launch and exit times, rank 0's stamps, and the losses by step."""
    stamps = run_dir.with_suffix(".stamps")
    cmd = [sys.executable, "-m", "paratron", "train", "--run-dir", str(run_dir), "--nproc-per-node", str(ranks)]
    for o in overrides + [f"train.callbacks={Path(__file__).resolve()}:Stamps"]:
        cmd += ["--set", o]
    env = {**os.environ, STAMP_ENV: str(stamps), REQUEST_ENV: json.dumps(request or {}), "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    t_exit = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in stamps.read_text().splitlines()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"launch": t0, "exit": t_exit, "events": events,
            "losses": {r["iteration"]: r["loss"] for r in records if "loss" in r}, "log": proc.stdout}


def _at(events, event: str, iteration: int) -> float:
    return next(e["t"] for e in events if e["event"] == event and e["iteration"] == iteration)


def online(ranks: int, base: list[str], change: Change, at: int, iters: int, work: Path) -> dict:
    """One job with the change requested after step ``at``: the seconds of that boundary and of
    a plain one (median over the others)."""
    run = train(ranks, base + change.start + list(change.online_extra) + [f"train.train_iters={iters}"],
                work / f"online-{time.time_ns()}",
                {"at": at, "request": change.request})
    ev = run["events"]
    gaps = [_at(ev, "start", i) - _at(ev, "end", i) for i in range(1, iters)]
    return {"seconds": gaps[at - 1], "plain_boundary": statistics.median(gaps[:at - 1] + gaps[at:]),
            "losses": run["losses"]}


def restart(ranks: int, base: list[str], change: Change, at: int, iters: int, work: Path) -> dict:
    """Save after step ``at`` and exit; a second job at the new layout loads and goes on."""
    ck, tag = work / f"ck-{time.time_ns()}", time.time_ns()
    first = train(change.start_ranks or ranks, base + change.start + [f"train.train_iters={at}", f"checkpoint.save={ck}"],
                  work / f"restart-a-{tag}")
    second = train(ranks, base + change.target + [f"train.train_iters={iters}", f"checkpoint.load={ck}",
                                                  "checkpoint.save=none"], work / f"restart-b-{tag}")
    save_exit = first["exit"] - _at(first["events"], "end", at)
    start_load = _at(second["events"], "start", at) - second["launch"]
    return {"seconds": save_exit + start_load, "save_and_exit": save_exit, "launch_to_step": start_load,
            "losses": second["losses"]}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def compare(ranks: int, data: list[str], change: Change, at: int, iters: int, repeats: int, work: Path) -> dict:
    """``repeats`` online and restart runs, alternating which goes first; medians and every run."""
    base, out = MODEL + RUN + data, {"online": [], "restart": []}
    ways = {"online": online, "restart": restart}
    for r in range(repeats):
        for name in (("online", "restart") if r % 2 == 0 else ("restart", "online")):
            out[name].append(ways[name](ranks, base, change, at, iters, work))
    after = range(at + 1, iters + 1)
    same = all([o["losses"][i] for i in after] == [s["losses"][i] for i in after]
               for o in out["online"] for s in out["restart"])
    med = {k: statistics.median(x["seconds"] for x in v) for k, v in out.items()}
    return {"ranks": ranks, "median_s": med, "restart_over_online": med["restart"] / med["online"],
            "plain_boundary_s": statistics.median(x["plain_boundary"] for x in out["online"]),
            "restart_parts_s": {k: statistics.median(x[k] for x in out["restart"])
                                for k in ("save_and_exit", "launch_to_step")},
            "runs_s": {k: [round(x["seconds"], 3) for x in v] for k, v in out.items()},
            "losses_after_change_bitwise_equal": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--change", choices=sorted(CHANGES), default="split")
    ap.add_argument("--at", type=int, default=2, help="the change comes after this step")
    ap.add_argument("--iters", type=int, default=4, help="steps in all")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_elastic_relayout_") as tmp:
        work = Path(tmp)
        data = prepare_corpus(work)
        for ranks in args.ranks:
            before = _load()
            res = compare(ranks, data, CHANGES[args.change](ranks), args.at, args.iters, args.repeats, work)
            res.update(change=args.change, load_before=before, load_after=_load())
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
