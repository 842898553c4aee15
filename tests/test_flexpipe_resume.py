"""Exact resume with token-balanced microbatches (``data.microbatch_tokens``) through
``run_training`` at PP=2 on the lognormal corpus: 4 steps straight against 2 steps, a save, a new
process, a load and 2 steps give bitwise the same losses and validation losses, and the same
documents in the same microbatches (the data position, in documents, is checkpointed), and the
same ``consumed_tokens`` (the labels trained on, checkpointed too)."""

from __future__ import annotations

import json
import os

import torch

from paratron.local_ranks import run_ranks
from paratron.training.callbacks import Callback

STOP_AT = "PARATRON_TEST_STOP_AT"

TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4", "model.seq_length=256",
    "model.make_vocab_size_divisible_by=16", "model.hidden_dropout=0.1",  # RNG streams matter too
    "model.position_embedding_type=rope", "model.normalization=rmsnorm",
    "data.microbatch_tokens=512", "data.split=80,20,0", "parallel.pipeline=2",
    "train.global_batch_size=8", "train.train_iters=4", "train.eval_interval=2", "train.eval_iters=1",
    "train.deterministic=true", "train.seed=11", "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=1",
    "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false",
]


class StopAt(Callback):
    """Asks to stop after iteration ``$PARATRON_TEST_STOP_AT`` (the trainer then saves)."""

    def __init__(self, state):
        self.stop_at = int(os.environ.get(STOP_AT, "0"))

    def on_step_end(self, state, metrics, timings):
        if self.stop_at and state.iteration >= self.stop_at:
            state.should_stop = True


def _train(overrides: list[str], run_dir: str, stop_at: int):
    """One rank of a run; returns its exit code and the token rows it trained and validated on."""
    import paratron.training.evaluator as evaluator
    import paratron.launch.runner as runner
    import paratron.training.trainer as trainer
    from paratron.rules import load_config

    os.environ[STOP_AT] = str(stop_at)
    seen = {"train": [], "valid": []}
    real = trainer.run_global_batch

    def spy(cfg, ctx, chunks, microbatches, *, forward_only, **kw):
        seen["valid" if forward_only else "train"].append([mb["tokens"][0].clone() for mb in microbatches])
        return real(cfg, ctx, chunks, microbatches, forward_only=forward_only, **kw)

    trainer.run_global_batch = evaluator.run_global_batch = spy  # this forked rank only
    return runner.run_training(load_config(None, overrides), run_dir), seen


def _run(tmp_path, name, overrides, stop_at=0):
    run_dir = tmp_path / name
    out = run_ranks(_train, 2, overrides, str(run_dir), stop_at, timeout=300)
    assert [code for code, _ in out] == [0, 0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: (r["loss"], r["consumed_tokens"]) for r in records if "loss" in r}
    val = {r["iteration"]: r["val_loss"] for r in records if "val_loss" in r}
    return losses, val, [seen for _, seen in out]


def test_exact_resume_token_balanced_pp2(tiny_corpus, tmp_path):
    from paratron.data.lognormal import write_lognormal_dataset
    from paratron.data.provenance import read_record

    tiny_prefix = next(o.split("=", 1)[1] for o in tiny_corpus if o.startswith("data.data_path="))
    tok = read_record(tiny_prefix)["tokenizer"]
    prefix = str(tmp_path / "lognormal")
    write_lognormal_dataset(prefix, 60, tok["vocab_size"], tok["eod"], seed=2)
    base = TINY + [o for o in tiny_corpus if not o.startswith("data.data_path=")] + [f"data.data_path={prefix}"]
    ck = tmp_path / "ck"
    straight, straight_val, seen_a = _run(tmp_path, "straight", base)
    extra = [f"checkpoint.save={ck}", "train.callbacks=test_flexpipe_resume:StopAt"]
    first, _, seen_b1 = _run(tmp_path, "first", base + extra, stop_at=2)
    assert sorted(first) == [1, 2] and (ck / "latest").read_text().strip() == "step_2"
    # the position's unit is saved, so a resume with data.microbatch_tokens unset can warn
    assert json.loads((ck / "step_2" / "paratron.json").read_text())["extra"]["data_position_unit"] == "documents"
    resumed, resumed_val, seen_b2 = _run(tmp_path, "resumed", base + [f"checkpoint.load={ck}"])
    assert sorted(resumed) == [3, 4] and sorted(straight) == [1, 2, 3, 4]
    for it in (3, 4):
        # bitwise losses; consumed_tokens (the labels trained on, checkpointed) continues exactly
        assert resumed[it] == straight[it], f"iteration {it}: {resumed[it]!r} vs {straight[it]!r}"
    assert resumed_val == {k: v for k, v in straight_val.items() if k > 2} and resumed_val
    for rank in range(2):
        for kind in ("train", "valid"):
            whole, parts = seen_a[rank][kind], seen_b1[rank][kind] + seen_b2[rank][kind]
            assert len(parts) == len(whole), (rank, kind)
            for i, (got, want) in enumerate(zip(parts, whole)):
                assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), \
                    f"rank {rank} {kind} step {i}"
    # the rows vary in length: the pipeline ran microbatches of different shapes
    assert any(len({len(t) for t in step}) > 1 for step in seen_a[0]["train"])


def test_switching_microbatch_tokens_on_resume_warns():
    """The data position is counted in documents with data.microbatch_tokens and in samples
    without: a resume across the switch reads other text, so it warns (it was silent)."""
    from paratron.config import Config
    from paratron.training.trainer import data_position_mismatch, data_position_unit

    flex, fixed = Config(), Config()
    flex.data.microbatch_tokens = 512
    saved_flex = {"consumed_train_samples": 24, "data_position_unit": data_position_unit(flex)}
    saved_fixed = {"consumed_train_samples": 24, "data_position_unit": data_position_unit(fixed)}
    assert data_position_mismatch(saved_flex, flex) is None and data_position_mismatch(saved_fixed, fixed) is None
    assert "24 documents" in data_position_mismatch(saved_flex, fixed)
    assert "24 samples" in data_position_mismatch(saved_fixed, flex)
    assert data_position_mismatch({"consumed_train_samples": 24}, fixed) is None  # older checkpoints
