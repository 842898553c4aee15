"""Fail-slow plugin: detection delay and the mitigated / unmitigated step-time ratio.

DP=2 (2 gloo ranks, one thread each), a small GPT on a 40-document slice of the bundled corpus,
global batch 12 (6 microbatches per rank when even). Rank 1 is slowed 2x by sleep injection
(``paratron.plugins.failslow_inject``).

The machine this was written on is shared and its load swings by 2x within a minute, so separate
runs cannot be compared. The ratio is measured inside one run instead: :class:`Alternating` is
:class:`~paratron.plugins.failslow.FailSlow` with its re-split applied in blocks of ``BLOCK``
steps, every other block (the others run the even split), so mitigated and unmitigated steps
interleave under the same load. Step time: the median ``step_time_s`` of each kind, after
detection; a block's first step is left out (its schedule is built then). A second run with no
slowdown gives the even reference. Ideal mitigated / unmitigated for a 2x slow rank: 8 / 12 = 0.67
(the split 8 + 4 against 6 + 6). Outputs go to a temporary directory.

    .venv/bin/python benchmarks/bench_failslow.py [--iters 40]
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

from paratron.plugins.failslow import FailSlow  # noqa: E402

MODEL = ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4", "model.seq_length=64",
         "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16", "train.micro_batch_size=1",
         "train.global_batch_size=12", "train.eval_interval=0", "train.eval_iters=0", "train.deterministic=true",
         "train.seed=5", "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=1", "logging.log_interval=1",
         "logging.tensorboard=false", "data.split=90,10,0"]


BLOCK = 3


class Alternating(FailSlow):
    """FailSlow whose re-split is applied only in every other block of ``BLOCK`` steps; each
    step's record says which kind it was (``bench_kind``)."""

    def after_detection(self, state, metrics: dict) -> None:
        super().after_detection(state, metrics)
        self.split = state.dp_microbatches if state.dp_microbatches is not None else getattr(self, "split", None)
        on = (state.iteration // BLOCK) % 2 == 1  # the next step's block
        state.dp_microbatches = self.split if on else None
        metrics["bench_kind"] = "mitigated" if (state.iteration - 1) // BLOCK % 2 == 1 and self.flagged else (
            "unmitigated" if self.flagged else "before")
        metrics["bench_first_of_block"] = (state.iteration - 1) % BLOCK == 0


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

    from paratron.rules import load_config
    from paratron.launch.runner import run_training

    os.environ["PARATRON_SLOW_RANK"] = slow
    with contextlib.redirect_stdout(io.StringIO()):
        return run_training(load_config(None, overrides), run_dir)


def _run(base: list[str], run_dir: Path, slow: str) -> list[dict]:
    from paratron.local_ranks import run_ranks

    cbs = (f'train.callbacks=["{Path(__file__).resolve()}:Alternating", '
           '"paratron.plugins.failslow_inject:SlowRank"]')
    run_ranks(_rank, 2, base + [cbs], str(run_dir), slow, timeout=3000)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("load average before:", os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="bench_failslow_") as tmp:
        base = MODEL + _corpus(Path(tmp)) + [f"train.train_iters={args.iters}"]
        even = _run(base, Path(tmp) / "even", "")
        recs = _run(base, Path(tmp) / "slow", "1:2")
    flags = [e for x in recs for e in x.get("failslow", [])]
    print(f"flags (slow run): {flags}; false flags (even run): {[e for x in even for e in x.get('failslow', [])]}")
    kinds = {k: [x["step_time_s"] for x in recs if x.get("bench_kind") == k and not x["bench_first_of_block"]]
             for k in ("unmitigated", "mitigated")}
    splits = sorted({tuple(x["failslow_dp_microbatches"] or ()) for x in recs if "failslow_dp_microbatches" in x})
    med = {k: statistics.median(v) for k, v in kinds.items()}
    kinds["even"] = [x["step_time_s"] for x in even if "step_time_s" in x]
    med["even"] = statistics.median(kinds["even"])
    print(f"detection delay (steps, window 3): {flags[0]['iteration'] if flags else None}; splits seen: {splits}")
    print("median step time: " + ", ".join(f"{k} {v:.4f} s (n={len(kinds.get(k, []))})" for k, v in med.items()))
    print(f"mitigated / unmitigated = {med['mitigated'] / med['unmitigated']:.3f} (ideal 0.667); "
          f"unmitigated / even = {med['unmitigated'] / med['even']:.3f}")
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
