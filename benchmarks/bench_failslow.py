"""Fail-slow plugin: detection delay and the mitigated / unmitigated step-time ratio.

DP=2 (2 gloo ranks, one thread each), a small GPT on a 40-document slice of the bundled corpus,
global batch 12 (6 microbatches per rank when even). Rank 1 is slowed 2x by sleep injection
(``paratron.plugins.failslow_inject``). Three runs side by side, in this order per round:

* ``even``: no slowdown, detector on (the reference: what the step costs with no slow rank);
* ``unmitigated``: rank 1 slowed, :class:`~paratron.plugins.failslow.FailSlowDetector` only;
* ``mitigated``: rank 1 slowed, :class:`~paratron.plugins.failslow.FailSlow` (microbatches move
  to rank 0 once rank 1 is flagged).

Step time: the median ``step_time_s`` of the steps after ``--skip`` (past detection and the
re-split). Ideal ratio mitigated / unmitigated for a 2x slow rank: 8 / 12 = 0.67 (the split
8 + 4 against 6 + 6). Outputs go to a temporary directory.

    .venv/bin/python benchmarks/bench_failslow.py [--rounds 1] [--iters 14] [--skip 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "model.seq_length=64",
         "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16", "train.micro_batch_size=1",
         "train.global_batch_size=12", "train.eval_interval=0", "train.eval_iters=0", "train.deterministic=true",
         "train.seed=5", "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=1", "logging.log_interval=1",
         "logging.tensorboard=false", "data.split=90,10,0"]


def _corpus(d: Path) -> list[str]:
    lines = (ROOT / "data" / "shakespeare.jsonl").read_text().splitlines()[:40]
    (d / "tiny.jsonl").write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, "-m", "paratron", "preprocess", "--input", str(d / "tiny.jsonl"),
                    "--output-prefix", str(d / "tiny"), "--tokenizer-type", "ByteLevelBPE", "--vocab-size", "512",
                    "--workers", "1"], check=True, capture_output=True, cwd=ROOT)
    tok = next(d.glob("tiny*tokenizer.json"))
    return [f"data.data_path={d / 'tiny'}", "data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={tok}"]


def _rank(overrides: list[str], run_dir: str, slow: str):
    import contextlib
    import io

    from paratron.config import load_config
    from paratron.training.runner import run_training

    os.environ["PARATRON_SLOW_RANK"] = slow
    with contextlib.redirect_stdout(io.StringIO()):
        return run_training(load_config(None, overrides), run_dir)


def _run(base: list[str], run_dir: Path, plugin: str, slow: str) -> list[dict]:
    from paratron.testing import run_ranks

    cbs = f'train.callbacks=["paratron.plugins.failslow:{plugin}", "paratron.plugins.failslow_inject:SlowRank"]'
    run_ranks(_rank, 2, base + [cbs], str(run_dir), slow, timeout=1800)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--iters", type=int, default=14)
    ap.add_argument("--skip", type=int, default=6, help="steps left out of the step-time median")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("load average before:", os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="bench_failslow_") as tmp:
        base = MODEL + _corpus(Path(tmp)) + [f"train.train_iters={args.iters}"]
        times: dict[str, list[float]] = {"even": [], "unmitigated": [], "mitigated": []}
        delays, splits = [], []
        for r in range(args.rounds):
            for name, plugin, slow in (("even", "FailSlowDetector", ""), ("unmitigated", "FailSlowDetector", "1:2"),
                                       ("mitigated", "FailSlow", "1:2")):
                recs = _run(base, Path(tmp) / f"{name}{r}", plugin, slow)
                steps = [x["step_time_s"] for x in recs if "step_time_s" in x][args.skip:]
                times[name].append(statistics.median(steps))
                flags = [e for x in recs for e in x.get("failslow", [])]
                if name == "unmitigated":
                    delays.append(next((e["iteration"] for e in flags if e["rank"] == 1), None))
                if name == "mitigated":
                    splits.append([x["failslow_dp_microbatches"] for x in recs if "failslow_dp_microbatches" in x])
                print(f"round {r} {name}: median step {times[name][-1]:.4f} s; flags {flags}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"detection delay (steps, window 3): {delays}; DP splits applied: {splits}")
    print("median step time: " + ", ".join(f"{k} {v:.4f} s" for k, v in med.items()))
    print(f"mitigated / unmitigated = {med['mitigated'] / med['unmitigated']:.3f} (ideal 0.667); "
          f"unmitigated / even = {med['unmitigated'] / med['even']:.3f}")
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
