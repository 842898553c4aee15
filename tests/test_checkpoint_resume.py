"""Exact resume through ``run_training``: 6 steps straight against 3 steps, a save, a new process,
a load and 3 steps (dp2 with ZeRO-1, dropout on): bitwise losses, the same train and validation
batches in the same order, and the optimizer state right after the load equal to the saved one.
(Resuming under other layouts: tests/test_checkpoint_optim.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from paratron.local_ranks import run_ranks
from paratron.training.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
STOP_AT = "PARATRON_TEST_STOP_AT"

TINY = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.seq_length=16", "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16",
    "model.hidden_dropout=0.1",  # RNG streams matter for an exact resume
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_iters=6",
    "train.eval_interval=2", "train.eval_iters=1", "train.deterministic=true", "train.seed=11",
    "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=2", "optimizer.clip_grad=1.0",
    "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false",
]


@pytest.fixture(scope="module")
def tiny_data(tiny_corpus):
    return tiny_corpus + ["data.split=80,20,0"]


def _snapshot(state, name: str) -> None:
    opt = state.optimizer
    st = {k: [v.clone() for v, _ in pieces] for k, pieces in opt.sharded_state_dict().items()}
    torch.save({"state": st, "step": opt.step_count, "iteration": state.iteration},
               state.run_dir / f"{name}_rank{state.ctx.rank}.pt")


class Probe(Callback):
    """Stops after iteration ``$PARATRON_TEST_STOP_AT`` (the runner then saves), and snapshots the
    optimizer state right after each save and right after a load."""

    def __init__(self, state):
        self.stop_at = int(os.environ.get(STOP_AT, "0"))

    def on_train_start(self, state):
        if state.config.checkpoint.load:
            _snapshot(state, "loaded")

    def on_step_end(self, state, metrics, timings):
        if self.stop_at and state.iteration >= self.stop_at:
            state.should_stop = True

    def on_save_end(self, state, path):
        _snapshot(state, "saved")


def _train(overrides: list[str], run_dir: str, stop_at: int = 0):
    """One rank of a run; returns the token batches it fed to training and to validation, and
    how many init tiles it drew (``"draws"``)."""
    import paratron.layers.init as init
    import paratron.training.evaluator as evaluator
    import paratron.launch.runner as runner
    import paratron.training.trainer as trainer
    from paratron.rules import load_config

    if stop_at:
        os.environ[STOP_AT] = str(stop_at)
    seen = {"train": [], "valid": [], "draws": 0}
    real = trainer.run_global_batch
    real_fill = init._fill_tiles_

    def count_fill(*args, **kw):
        seen["draws"] += 1
        return real_fill(*args, **kw)

    init._fill_tiles_ = count_fill  # this forked rank only

    def spy(cfg, ctx, chunks, microbatches, *, forward_only, **kw):
        seen["valid" if forward_only else "train"].append(torch.cat([mb["tokens"] for mb in microbatches]))
        return real(cfg, ctx, chunks, microbatches, forward_only=forward_only, **kw)

    trainer.run_global_batch = evaluator.run_global_batch = spy  # this forked rank only
    code = runner.run_training(load_config(None, overrides), run_dir)
    return code, seen


def _run(tmp_path, name, overrides, world, stop_at=0):
    run_dir = tmp_path / name
    out = run_ranks(_train, world, overrides, str(run_dir), stop_at, timeout=300)
    assert [c for c, _ in out] == [0] * world
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    val = {r["iteration"]: r["val_loss"] for r in records if "val_loss" in r}
    return losses, val, [s for _, s in out], run_dir


def test_exact_resume_in_a_new_process(tiny_data, tmp_path):
    base = TINY + tiny_data + ["parallel.zero=1"]  # dp2 with ZeRO-1 slices
    ck = tmp_path / "ck"
    straight, straight_val, seen_a, _ = _run(tmp_path, "straight", base, 2)
    assert sorted(straight) == [1, 2, 3, 4, 5, 6]
    extra = [f"checkpoint.save={ck}", "train.callbacks=test_checkpoint_resume:Probe"]
    first, _, seen_b1, dir_b1 = _run(tmp_path, "first", base + extra, 2, stop_at=3)
    assert sorted(first) == [1, 2, 3] and (ck / "latest").read_text().strip() == "step_3"
    resumed, resumed_val, seen_b2, dir_b2 = _run(
        tmp_path, "resumed", base + [f"checkpoint.load={ck}", "train.callbacks=test_checkpoint_resume:Probe"], 2)
    assert sorted(resumed) == [4, 5, 6]
    # no init before a load: the resumed run draws nothing for the params the checkpoint holds
    assert all(s["draws"] > 0 for s in seen_a) and all(s["draws"] == 0 for s in seen_b2), \
        ([s["draws"] for s in seen_a], [s["draws"] for s in seen_b2])
    for it in (4, 5, 6):
        assert resumed[it] == straight[it], f"iteration {it}: {resumed[it]!r} vs {straight[it]!r}"
    assert resumed_val == {k: v for k, v in straight_val.items() if k > 3}
    for rank in range(2):
        for kind in ("train", "valid"):
            before, after, whole = seen_b1[rank][kind], seen_b2[rank][kind], seen_a[rank][kind]
            assert len(before) + len(after) == len(whole), (rank, kind)
            for i, (got, want) in enumerate(zip(before + after, whole)):
                assert torch.equal(got, want), f"rank {rank} {kind} batch {i}"
        saved = torch.load(dir_b1 / f"saved_rank{rank}.pt")
        loaded = torch.load(dir_b2 / f"loaded_rank{rank}.pt")
        assert saved["step"] == loaded["step"] == 3 and loaded["iteration"] == 3
        assert saved["state"].keys() == loaded["state"].keys()
        assert any("exp_avg_sq" in k for k in saved["state"])
        for k in saved["state"]:
            for a, b in zip(saved["state"][k], loaded["state"][k]):
                assert torch.equal(a, b), k


def test_finetune_loads_weights_only_and_starts_at_step_0(tiny_data, tmp_path):
    """``checkpoint.finetune`` (Megatron's ``--finetune``): the weights of step 3, then a new run
    from iteration 1 with a fresh optimizer (step 0, zero moments) whose main weights are the
    saved ones; a plain load of the same checkpoint resumes at iteration 4."""
    base = TINY + tiny_data + ["parallel.zero=1", "train.callbacks=test_checkpoint_resume:Probe"]
    ck = tmp_path / "ck"
    _, _, _, dir_a = _run(tmp_path, "first", base + [f"checkpoint.save={ck}"], 2, stop_at=3)
    tuned, _, _, dir_b = _run(tmp_path, "tuned", base + [f"checkpoint.load={ck}", "checkpoint.finetune=true",
                                                         "train.train_iters=2"], 2)
    assert sorted(tuned) == [1, 2]
    for rank in range(2):
        saved = torch.load(dir_a / f"saved_rank{rank}.pt")
        loaded = torch.load(dir_b / f"loaded_rank{rank}.pt")
        assert loaded["step"] == 0 and loaded["iteration"] == 0, loaded["step"]
        mains = [k for k in saved["state"] if "/main_param/" in k]
        assert mains, list(saved["state"])[:5]
        for k in mains:
            for a, b in zip(saved["state"][k], loaded["state"][k]):
                assert torch.equal(a, b), k
        moments = [k for k in loaded["state"] if "/exp_avg" in k]
        assert moments and all(not t.any() for k in moments for t in loaded["state"][k])
