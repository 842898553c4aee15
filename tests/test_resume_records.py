"""The records of a run resumed into its own run directory: one record per iteration in
``metrics.jsonl`` (the redone iterations' earlier records moved to ``metrics.superseded.jsonl``),
TensorBoard told to discard the redone steps, and ``loss.png`` drawn from the current records of
the whole run. (The kill/resume soak checks the same after ten SIGKILLs: tests/test_soak.py.)
And the loss scaler's counters, which a checkpoint carries in the optimizer's scalar state.
(The trainer's counters across a resume: tests/test_nonfinite_policy.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from paratron.checkpoint.manager import CheckpointManager
from paratron.config import CheckpointConfig
from paratron.local_ranks import run_ranks
from paratron.models.gpt import build_model_chunks
from paratron.optim import DistributedDataParallel, build_optimizer
from paratron.parallel.context import ParallelContext
from paratron.training.metrics import SUPERSEDED, MetricsWriter, plot_losses, read_metrics, split_at_resume
from test_weights_only_load import weights_config

TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.seq_length=16", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_iters=4",
    "train.eval_interval=2", "train.eval_iters=1", "train.deterministic=true", "train.seed=5",
    "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=1", "logging.log_interval=1",
    "logging.tensorboard=false", "logging.progress=false", "checkpoint.interval=2", "checkpoint.keep_last=0",
    "train.sample_tokens=0", "data.split=90,10,0",
]


def _train(overrides: list[str], run_dir: str) -> int:
    from paratron.rules import load_config
    import paratron.launch.runner as runner

    return runner.run_training(load_config(None, overrides), run_dir)


def _tensorboard_purges(log_dir) -> list[list[int]]:
    """Per event file, in the order written: the steps of its ``SessionLog.START`` events (a
    start at step s tells TensorBoard to drop the earlier files' events from step s on)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    files = [list(EventFileLoader(str(p)).Load()) for p in log_dir.glob("events.out.tfevents.*")]
    return [[e.step for e in events if e.HasField("session_log") and e.session_log.status == SessionLog.START]
            for events in sorted(files, key=lambda events: events[0].wall_time)]


def _pixels(path):
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def test_a_resume_leaves_one_record_per_iteration(tiny_corpus, tmp_path):
    """One rank, 4 steps with saves and evaluations at 2 and 4; then a resume from step_2 into the
    same run directory (as after a kill between the saves) redoes steps 3 and 4."""
    run, ck = tmp_path / "run", tmp_path / "ck"
    over = TINY + tiny_corpus + [f"checkpoint.save={ck}"]
    assert run_ranks(_train, 1, over, str(run), timeout=300) == [0]
    first = read_metrics(run / "metrics.jsonl")
    assert run_ranks(_train, 1, over + [f"checkpoint.load={ck}", "checkpoint.load_step=2"], str(run),
                     timeout=300) == [0]
    records = read_metrics(run / "metrics.jsonl")
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert [r["iteration"] for r in records if "val_loss" in r] == [2, 4]
    assert len(records) == len((run / "metrics.jsonl").read_text().splitlines())
    # The replaced records, in order and marked; the deterministic rerun repeats their losses.
    old = read_metrics(run / SUPERSEDED)
    assert [(r["iteration"], "loss" in r) for r in old] == [(3, True), (4, True), (4, False)]
    assert all(r["superseded_by_resume_at"] == 2 for r in old)
    assert [r["loss"] for r in records if r.get("iteration", 0) > 2 and "loss" in r] == \
        [r["loss"] for r in first if r.get("iteration", 0) > 2 and "loss" in r]
    # loss.png is the plot of the current records of the whole run (steps 1-4, not only 3-4).
    plot_losses(records, tmp_path / "want.png")
    assert (_pixels(run / "loss.png") == _pixels(tmp_path / "want.png")).all()


def test_tensorboard_discards_the_redone_steps(tmp_path):
    """The writer of a run resumed after step 2 starts its events file with a purge of steps >= 3
    (TensorBoard then shows the earlier file's steps 1-2 and the new file's 3-4, each once);
    metrics.jsonl is cut the same way."""
    for start, steps in ((0, (1, 2, 3, 4)), (2, (3, 4))):
        w = MetricsWriter(tmp_path, True, True)
        w.start(start)
        for it in steps:
            w.write({"iteration": it, "loss": 10.0 - it - start})
        w.close()
    assert _tensorboard_purges(tmp_path / "tensorboard") == [[1], [3]]
    assert [(r["iteration"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(1, 9.0), (2, 8.0), (3, 5.0), (4, 4.0)]


@pytest.mark.parametrize("lines, iteration, cut", [
    (['{"iteration": 1, "loss": 2}', '{"record": "startup"}', '{"iteration": 2, "loss": 1}'], 1, 2),
    (['{"iteration": 1, "loss": 2}', '{"record": "startup"}'], 1, 2),
    (['{"iteration": 1, "loss": 2}', '{"iteration": 2, "lo'], 5, 1),  # a line cut by a kill
    (['{"iteration": 3, "loss": 2}'], 0, 0),  # a fresh start replaces every earlier record
])
def test_split_at_resume(lines, iteration, cut):
    assert split_at_resume(lines, iteration) == cut


def test_read_metrics_leaves_out_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"iteration": 1, "loss": 2.0}) + "\n" + '{"iteration": 2, "lo')
    assert read_metrics(path) == [{"iteration": 1, "loss": 2.0}]
    assert read_metrics(tmp_path / "none.jsonl") == []


def test_loss_scaler_counters_survive_a_checkpoint(tmp_path):
    """fp16: the scale, the clean steps since the last growth and the hysteresis left are saved
    and restored with the optimizer (a resume must not restart the growth window)."""
    cfg, ctx = weights_config(), ParallelContext.single()

    def build():
        chunks = build_model_chunks(cfg.model, ctx, seed=3, params_dtype=torch.float16)
        opt = build_optimizer(chunks, ctx, cfg.optimizer, DistributedDataParallel(chunks, ctx), precision="fp16")
        return chunks, opt

    chunks, opt = build()
    opt.scaler.scale, opt.scaler.growth_tracker, opt.scaler.hysteresis_tracker = 512.0, 7, 1
    CheckpointManager(CheckpointConfig(save=str(tmp_path)), ctx, cfg).save(3, chunks, opt, None)
    chunks, fresh = build()
    CheckpointManager(CheckpointConfig(load=str(tmp_path)), ctx, cfg).load(chunks, fresh, None)
    assert (fresh.scaler.scale, fresh.scaler.growth_tracker, fresh.scaler.hysteresis_tracker) == (512.0, 7, 1)


def test_a_replaced_rank_0_writes_the_step_record_its_predecessor_missed(tmp_path):
    """Rank 0 killed after a step's commit point but before its metrics line: the survivors went
    on from that step, and ``metrics.jsonl`` had no record of it (seen as a missing iteration 2).
    The replacement writes the survivors' record of the step, once, and never over one there."""
    from paratron.training.metrics import METRICS, MetricsWriter, read_metrics

    w = MetricsWriter(tmp_path, True, False)
    w.start(0)
    w.write({"iteration": 1, "loss": 6.2})
    w.close()
    w = MetricsWriter(tmp_path, True, False)  # the replacement, at iteration 2
    w.start(2)
    assert w.write_if_missing({"iteration": 2, "loss": 6.1})
    assert not w.write_if_missing({"iteration": 2, "loss": 6.1})
    assert not w.write_if_missing({"iteration": 1, "loss": 9.9})
    w.close()
    assert [(r["iteration"], r["loss"]) for r in read_metrics(tmp_path / METRICS)] == [(1, 6.2), (2, 6.1)]
    assert not MetricsWriter(tmp_path, False, False).write_if_missing({"iteration": 3, "loss": 6.0})
