"""Kill/resume soak: SIGKILL a random rank at random moments, resume, compare with an uninterrupted run.

Usage::

    python scripts/soak_kill_resume.py [--workdir /tmp/soak] [--kills 10] [--save-kills 3] [--seed 0]

It trains a tiny deterministic fp32 model on 2 ranks (dp=2, ZeRO-1) with ``paratron train
--nproc-per-node 2``, saving every ``--interval`` steps. Each round resumes from ``latest``,
waits for one new checkpoint, then kills one random rank with SIGKILL, either 0-2 steps later
or while the next checkpoint is being written (a new ``tmp.step_*`` directory exists). After every kill it checks that ``latest`` names a
complete checkpoint that loads with finite values, and that no more than ``--interval`` logged
steps were lost. After the kills the run is resumed to the end, and its final parameters must be
bitwise equal to those of an uninterrupted run of the same config; its ``metrics.jsonl`` must hold
exactly one training record per step, with the uninterrupted run's losses (each resume moves the
records of the steps it redoes to ``metrics.superseded.jsonl``), and ``loss.png`` must be their plot.

Prints one JSON line of figures (kills, kills during a save, steps lost, wall time) and exits
non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.num_query_groups=2",
    "model.seq_length=16", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.eval_interval=0",
    "train.deterministic=true", "train.precision=fp32", "optimizer.lr_warmup_iters=2",
    "logging.log_interval=1000", "logging.tensorboard=false", "parallel.zero=1", "data.split=90,10,0",
    "checkpoint.keep_last=2",
]


def tiny_data(workdir: Path) -> list[str]:
    """Tokenize the first 40 documents of the bundled corpus (once) and return the overrides."""
    prefix = workdir / "data" / "tiny"
    if not prefix.with_suffix(".idx").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        lines = (ROOT / "data" / "shakespeare.jsonl").read_text().splitlines()[:40]
        (prefix.parent / "tiny.jsonl").write_text("\n".join(lines) + "\n")
        subprocess.run([sys.executable, "-m", "paratron", "preprocess", "--input", str(prefix.parent / "tiny.jsonl"),
                        "--output-prefix", str(prefix), "--tokenizer-type", "ByteLevelBPE", "--vocab-size", "512",
                        "--workers", "1"], check=True, capture_output=True, env=_env(), cwd=ROOT)
    tok = next(prefix.parent.glob("tiny*tokenizer.json"))
    return [f"data.data_path={prefix}", "data.tokenizer_type=HuggingFaceTokenizer", f"data.tokenizer_model={tok}"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def launch(run_dir: Path, save: Path, overrides: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paratron", "train", "--nproc-per-node", "2", "--run-dir", str(run_dir)]
    load = [f"checkpoint.load={save}"] if (save / "latest").exists() else []
    for o in overrides + [f"checkpoint.save={save}"] + load:
        cmd += ["--set", o]
    return subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def last_iteration(run_dir: Path) -> int:
    """The last training step logged in ``metrics.jsonl`` (0: none). A resumed run cuts the
    records of the steps it redoes from the file before its first step, so this is the last
    step of the current round once the round has saved."""
    from paratron.training.metrics import read_metrics

    its = [r["iteration"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    return its[-1] if its else 0


def check_records(run_dir: Path, reference: Path, train_iters: int) -> int:
    """``metrics.jsonl`` after the kills holds one training record per step, each with the loss of
    the uninterrupted run's, and ``loss.png`` is their plot; returns how many records the
    resumes replaced (kept in ``metrics.superseded.jsonl``)."""
    from matplotlib.image import imread

    from paratron.training.metrics import SUPERSEDED, plot_losses, read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    losses = [(r["iteration"], r["loss"]) for r in records if "loss" in r]
    assert [it for it, _ in losses] == list(range(1, train_iters + 1)), f"steps logged: {[it for it, _ in losses]}"
    want = [(r["iteration"], r["loss"]) for r in read_metrics(reference / "metrics.jsonl") if "loss" in r]
    assert losses == want, "the logged losses differ from the uninterrupted run's"
    plot_losses(records, run_dir / "expected_loss.png")
    assert (imread(run_dir / "loss.png") == imread(run_dir / "expected_loss.png")).all(), \
        "loss.png is not the plot of metrics.jsonl"
    return len(read_metrics(run_dir / SUPERSEDED))


def rank_pids(run_dir: Path) -> dict[int, int]:
    out = {}
    for p in (run_dir / "logs").glob("rank_*.status.json"):
        try:
            d = json.loads(p.read_text())
            out[d["rank"]] = d["pid"]
        except (OSError, ValueError, KeyError):
            pass
    return out


def check_latest(save: Path) -> int:
    """The step ``latest`` names, after loading that checkpoint fully and checking it is finite.

    Raises:
        AssertionError / CheckpointError: ``latest`` names a partial or unloadable checkpoint.
    """
    import torch

    from paratron.checkpoint.io import load_model_full, resolve

    d = resolve(save)
    _, tensors = load_model_full(d)
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values()), f"{d}: non-finite values"
    return int(d.name.split("_")[1])


def latest_name(save: Path) -> str:
    try:
        return (save / "latest").read_text().strip()
    except OSError:
        return ""


def kill_round(proc, run_dir: Path, save: Path, mode: str, rng: random.Random, timeout: float = 300):
    """Kill one random rank of ``proc``; returns (killed, last logged step).

    The kill waits until this round has written one new checkpoint (so that every round makes
    progress), then comes ``mode="step"``: 0-2 steps later, outside a save, after a random
    0-0.2 s; ``mode="save"``: while the next checkpoint is being written (a new ``tmp.step_*``).
    """
    deadline = time.time() + timeout
    stale = set(save.glob("tmp.step_*"))  # leftovers of saves killed in earlier rounds
    first_latest, kill_at = latest_name(save), None
    while proc.poll() is None and time.time() < deadline:
        pids = rank_pids(run_dir)
        it = last_iteration(run_dir)
        saving = bool(set(save.glob("tmp.step_*")) - stale)
        if len(pids) == 2 and latest_name(save) != first_latest:
            if kill_at is None:
                kill_at = it + rng.randint(0, 2)
            if (mode == "save" and saving) or (mode == "step" and it >= kill_at and not saving):
                if mode == "step":
                    time.sleep(rng.uniform(0, 0.2))
                try:
                    os.kill(pids[rng.randrange(2)], signal.SIGKILL)
                except ProcessLookupError:
                    continue
                return True, last_iteration(run_dir)
        time.sleep(0.005)
    return False, last_iteration(run_dir)


def soak(workdir: Path, kills: int = 10, save_kills: int = 3, seed: int = 0, train_iters: int = 60,
         interval: int = 3, data: list[str] | None = None) -> dict:
    """Run the soak in ``workdir`` (emptied first); returns the figures (raises on a failed check)."""
    import torch

    from paratron.checkpoint.io import load_model_full

    shutil.rmtree(workdir / "soak", ignore_errors=True)
    shutil.rmtree(workdir / "reference", ignore_errors=True)
    data = data if data is not None else tiny_data(workdir)
    overrides = CONFIG + data + [f"train.train_iters={train_iters}", f"checkpoint.interval={interval}"]
    rng = random.Random(seed)
    modes = ["save"] * save_kills + ["step"] * (kills - save_kills)
    rng.shuffle(modes)
    t0 = time.time()
    ref = launch(workdir / "reference", workdir / "reference" / "ckpt", overrides)
    assert ref.wait() == 0, ref.stderr.read()
    run_dir, save = workdir / "soak", workdir / "soak" / "ckpt"
    done, lost, at_save = 0, [], 0
    while done < kills:
        proc = launch(run_dir, save, overrides)
        mode = modes[done]
        killed, last_it = kill_round(proc, run_dir, save, mode, rng)
        rc = proc.wait(timeout=120)
        if not killed:
            raise AssertionError(f"round {done}: the job ended (exit {rc}) before a {mode} kill; raise "
                                 f"train_iters. stderr:\n{proc.stderr.read()}")
        assert rc != 0, "a killed job exited 0"
        step = check_latest(save) if (save / "latest").exists() else 0
        lost.append(last_it - step)
        assert last_it - step <= interval, f"kill {done}: last logged step {last_it}, latest {step}"
        at_save += mode == "save"
        done += 1
        print(f"kill {done} ({mode}): last logged step {last_it}, latest step {step}", file=sys.stderr, flush=True)
    final = launch(run_dir, save, overrides)
    assert final.wait() == 0, final.stderr.read()
    _, got = load_model_full(save)
    _, want = load_model_full(workdir / "reference" / "ckpt")
    assert got.keys() == want.keys()
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, f"final params differ from the uninterrupted run: {unequal[:5]}"
    superseded = check_records(run_dir, workdir / "reference", train_iters)
    return {"kills": done, "kills_during_save": at_save, "steps_lost": lost, "max_steps_lost": max(lost),
            "save_interval": interval, "train_iters": train_iters, "bitwise_equal": True,
            "one_record_per_step": True, "records_superseded": superseded,
            "final_step": check_latest(save), "wall_s": round(time.time() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/tmp/paratron-soak")
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--save-kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-iters", type=int, default=60)
    p.add_argument("--interval", type=int, default=3)
    a = p.parse_args(argv)
    workdir = Path(a.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(soak(workdir, a.kills, a.save_kills, a.seed, a.train_iters, a.interval)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
