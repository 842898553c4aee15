"""The non-finite policy through ``run_training`` (``train.nonfinite``): a NaN or inf written into
one rank's final grads at a chosen step. ``stop`` exits non-zero naming the step, before the
update, and leaves the last good checkpoint as ``latest`` (it loads, finite); ``skip`` changes
nothing in that step, goes on, and no checkpoint ever holds the poisoned state; the limit of
consecutive skips stops the run; checkpoints refuse a non-finite state; non-finite config values
are refused. (Bitwise skip parity over layouts and precisions: tests/test_optim_parallel.py.)"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from paratron.checkpoint.io import load_tensors_full
from paratron.config import ConfigError
from paratron.local_ranks import run_ranks
from paratron.rules import build_config, validate
from paratron.training.nonfinite import NonFiniteGuard, NonFiniteStop

TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.seq_length=16", "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_iters=4",
    "train.eval_interval=0", "train.eval_iters=0", "train.deterministic=true", "train.seed=5",
    "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=1", "optimizer.clip_grad=1.0",
    "logging.log_interval=1", "logging.tensorboard=false", "checkpoint.interval=1",
    "parallel.zero=1",
]


@pytest.fixture(scope="module")
def tiny_data(tiny_corpus):
    return tiny_corpus + ["data.split=90,10,0"]


def _train_poisoned(overrides: list[str], run_dir: str, bad_iteration, value: float):
    """One rank of a run whose grads on the last rank (rank 1 of 2) get ``value`` at step
    ``bad_iteration`` of this process (an int, or a collection of them), after they are final
    (so only that rank holds it); returns (exit code, rank 0's output)."""
    import paratron.launch.runner as runner
    import paratron.training.trainer as trainer
    from paratron.rules import load_config

    real, calls = trainer.run_global_batch, [0]
    bad = {bad_iteration} if isinstance(bad_iteration, int) else set(bad_iteration)

    def poisoned(cfg, ctx, chunks, microbatches, *, forward_only, ddp=None, **kw):
        out = real(cfg, ctx, chunks, microbatches, forward_only=forward_only, ddp=ddp, **kw)
        if not forward_only:
            calls[0] += 1
            if calls[0] in bad and ctx.rank == ctx.world_size - 1:
                ddp.owned_ranges(0)[0][2][0] = value
        return out

    trainer.run_global_batch = poisoned  # this forked rank only
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = runner.run_training(load_config(None, overrides), run_dir)
    return code, buf.getvalue()


def _all_finite(directory) -> bool:
    model, opt = load_tensors_full(directory, "model/"), load_tensors_full(directory, "optimizer/")
    assert model and opt, f"{directory} holds no model or optimizer tensors"
    return all(bool(torch.isfinite(t).all()) for t in [*model.values(), *opt.values()])


def test_stop_exits_nonzero_naming_the_step_and_keeps_the_last_checkpoint(tiny_data, tmp_path):
    """DP=2 with ZeRO-1, a NaN in rank 1's grads at step 2: every rank exits 1, rank 0 names
    iteration 2 and the param and rank; ``latest`` is step_1, which is finite, and no later
    checkpoint exists."""
    ck = tmp_path / "ck"
    over = TINY + tiny_data + ["train.nonfinite=stop", f"checkpoint.save={ck}"]
    out = run_ranks(_train_poisoned, 2, over, str(tmp_path / "run"), 2, float("nan"), timeout=300)
    assert [code for code, _ in out] == [1, 1]
    text = out[0][1]
    assert "iteration 2: non-finite loss or grads" in text and "on rank 1" in text, text
    assert (ck / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_1"]
    assert _all_finite(ck / "step_1")


def test_skip_goes_on_and_a_nan_never_reaches_a_checkpoint(tiny_data, tmp_path):
    """DP=2 with ZeRO-1, a NaN in rank 1's grads at step 3, a save after every step: the run
    ends with code 0 after 4 steps; step 3 is logged as skipped; step_3's model and optimizer
    state equal step_2's bitwise; every checkpoint is finite."""
    ck = tmp_path / "ck"
    over = TINY + tiny_data + ["train.nonfinite=skip", f"checkpoint.save={ck}", "checkpoint.keep_last=0"]
    out = run_ranks(_train_poisoned, 2, over, str(tmp_path / "run"), 3, float("nan"), timeout=300)
    assert [code for code, _ in out] == [0, 0]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["iteration"]: r["skipped_iterations"] for r in records if "loss" in r}
    assert skipped == {1: 0, 2: 0, 3: 1, 4: 1}
    assert "iteration 3: non-finite loss or grads" in out[0][1]
    for step in (1, 2, 3, 4):
        assert _all_finite(ck / f"step_{step}"), step
    for prefix in ("model/", "optimizer/"):
        two, three = load_tensors_full(ck / "step_2", prefix), load_tensors_full(ck / "step_3", prefix)
        assert two.keys() == three.keys()
        for k in two:
            assert torch.equal(two[k], three[k]), f"{prefix}{k} changed in the skipped step"


def test_skip_counts_carry_over_a_resume(tiny_data, tmp_path):
    """One rank, a save after every step, ``max_consecutive_skips = 4``. Run 1: NaN grads at
    steps 3 and 4 (both skipped; 2 in a row when step_4 is saved). Run 2 resumes from step_4 with
    NaN grads at steps 5 and 6: step 5 reports ``skipped_iterations = 3`` and step 6, the fourth
    non-finite step in a row, stops the run, as in an unbroken run."""
    ck, run = tmp_path / "ck", str(tmp_path / "run")
    over = TINY + tiny_data + ["train.nonfinite=skip", "train.max_consecutive_skips=4", f"checkpoint.save={ck}",
                               "checkpoint.keep_last=0"]
    [(code, _)] = run_ranks(_train_poisoned, 1, over, run, (3, 4), float("nan"), timeout=300)
    assert code == 0 and (ck / "latest").read_text().strip() == "step_4"
    resume = [f"checkpoint.load={ck}", "train.train_iters=8"]
    [(code, text)] = run_ranks(_train_poisoned, 1, over + resume, run, (1, 2), float("nan"), timeout=300)
    assert code == 1, text
    assert "iteration 5: non-finite loss or grads" in text and "step skipped (3 in a row, limit 4)" in text, text
    assert "iteration 6: non-finite" in text and "4 non-finite steps in a row reached" in text, text
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["iteration"]: r["skipped_iterations"] for r in records if "loss" in r} == \
        {1: 0, 2: 0, 3: 1, 4: 2, 5: 3}
    assert "skipped 3" in text, text  # the console line of step 5


def test_consecutive_skips_stop_at_the_limit():
    """skip: warnings until the limit of non-finite steps in a row; a finite step resets the
    count; stop: the first non-finite step raises, naming it."""
    guard = NonFiniteGuard("skip", 3)
    where = lambda: "first non-finite grad: w on rank 0"  # noqa: E731
    assert guard.check(1, False, where) is None
    assert "1 in a row" in guard.check(2, True, where)
    assert "2 in a row" in guard.check(3, True, where)
    assert guard.check(4, False, where) is None
    guard.check(5, True, where), guard.check(6, True, where)
    with pytest.raises(NonFiniteStop, match="iteration 7.*max_consecutive_skips=3"):
        guard.check(7, True, where)
    with pytest.raises(NonFiniteStop, match="iteration 2: .*w on rank 0.*'stop'"):
        NonFiniteGuard("stop", 5).check(2, True, where)


def test_the_run_of_skips_round_trips_and_old_checkpoints_start_at_zero():
    where = lambda: "w"  # noqa: E731
    guard = NonFiniteGuard("skip", 3)
    guard.check(1, True, where), guard.check(2, True, where)
    fresh = NonFiniteGuard("skip", 3)
    fresh.load_state_dict(guard.state_dict())
    with pytest.raises(NonFiniteStop, match="3 non-finite steps in a row"):
        fresh.check(3, True, where)
    fresh.load_state_dict({"iteration": 7})  # a checkpoint from before the count was saved
    assert fresh.in_a_row == 0


@pytest.mark.parametrize("override", ["optimizer.lr=nan", "optimizer.lr=inf", "optimizer.weight_decay=-inf",
                                      "optimizer.clip_grad=nan"])
def test_nonfinite_config_values_are_refused(override):
    with pytest.raises(ConfigError, match=override.split("=")[0] + ".*finite"):
        validate(build_config(None, [override]))
    assert not math.isnan(validate(build_config(None, [])).optimizer.lr)


def test_checkpoint_save_refuses_a_nonfinite_state(tmp_path):
    """One process, ``keep_last = 1``: a NaN in a param makes save() raise naming the tensor;
    nothing is written and nothing pruned (``latest`` still names the earlier, good save)."""
    from paratron.checkpoint.items import CheckpointError
    from paratron.checkpoint.manager import CheckpointManager
    from paratron.config import CheckpointConfig, Config
    from paratron.models.gpt import build_model_chunks
    from paratron.parallel.context import ParallelContext

    cfg = build_config(None, TINY[:6] + ["model.vocab_size=64"])
    ctx = ParallelContext.single()
    chunks = build_model_chunks(cfg.model, ctx, seed=1)
    mgr = CheckpointManager(CheckpointConfig(save=str(tmp_path), keep_last=1), ctx, Config(model=cfg.model))
    mgr.save(1, chunks, None, None)
    with torch.no_grad():
        chunks[0].final_norm.weight[0] = float("nan")
    with pytest.raises(CheckpointError, match="step 2: model/final_norm.weight holds an inf or NaN on rank 0"):
        mgr.save(2, chunks, None, None)
    mgr.wait()
    assert (tmp_path / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_1"]


def test_a_nonfinite_stop_is_named_in_the_launcher_summary(tmp_path, monkeypatch):
    """The rank ends on a stop with exit code 1 and no exception: its error record must still
    reach the launcher's summary (not "exited with code 1 without a Python error")."""
    import time

    from paratron.launch.failures import collect, summarize
    from paratron.training.nonfinite import NonFiniteStop
    from paratron.launch.mode import LOG_DIR_ENV
    from paratron.launch.rankproc import record_failure

    monkeypatch.setenv(LOG_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    try:
        raise NonFiniteStop("iteration 2: non-finite loss or grads")
    except NonFiniteStop as exc:
        record_failure(exc)
    lines = summarize(collect(tmp_path, {1: time.time()}, {1: 1}), tmp_path)
    assert lines[0] == "rank 1 failed first: NonFiniteStop: iteration 2: non-finite loss or grads", lines
