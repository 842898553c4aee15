"""Delay-aware 1F1B (CrossPipe): per-link costs in the simulator, the ``1f1b-delay``
schedule's warm-ups from link costs, and the runtime's p2p delay injector: with 40 ms injected on
the link between stages 1 and 2 at PP=4, ``1f1b-delay`` gives 1F1B's losses and grads to 1e-6
(fp32). Its makespan against 1F1B under delay is measured in benchmarks/, not asserted here.
"""

from __future__ import annotations

import time

import pytest
import torch

from paratron.models.gpt import build_model_chunks
from paratron.optim import finalize_grads
from paratron.parallel.context import ParallelContext
from paratron.pipeline.delay import LinkDelay, delay_warmups
from paratron.pipeline.partition import stage_layers
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.runtime import run_pipeline
from paratron.pipeline.simulator import Costs, simulate
from paratron.local_ranks import run_ranks

from helpers import perturb_1d_params_
from test_pipeline_runtime import GLOBAL_BATCH, HIDDEN, LAYERS, SEED, SEQ, _cfg, _forward_step, _global_batch

TOL = 1e-6
DELAY = LinkDelay((1, 2), 0.040)


def _run(p, m):
    ctx = ParallelContext.build(pp=p)
    ids, labels = _global_batch()
    total = (labels != -100).sum()
    mbs = GLOBAL_BATCH // m
    micro = [(ids[i * mbs:(i + 1) * mbs], labels[i * mbs:(i + 1) * mbs]) for i in range(m)]
    out = {}
    for name, options in (("1f1b", {}), ("1f1b-delay", {"link_latency": [0, 0.04, 0], "microbatch_time": 0.02})):
        chunks = build_model_chunks(_cfg(), ctx, seed=SEED, stage_layers=stage_layers(LAYERS, p, 1, None, "1f1b"))
        perturb_1d_params_(chunks)
        lists = build_schedule(name, p, m, 1, **options)
        start = time.perf_counter()
        losses = run_pipeline(lists[ctx.pp.rank], chunks, DELAY.over(ctx), micro, _forward_step(total),
                              (SEQ, mbs, HIDDEN), torch.float32)
        elapsed = time.perf_counter() - start
        finalize_grads(chunks, ctx)
        out[name] = ([x.item() for x in losses], {q.meta.logical_name: q.grad.clone() for c in chunks for q in c.parameters()},
                     elapsed)
    return out


def test_delay_schedule_matches_1f1b_under_injected_delay():
    results = run_ranks(_run, 4, 4, 8, timeout=300)
    for rank_out in results:
        ref_losses, ref_grads, _ = rank_out["1f1b"]
        losses, grads, _ = rank_out["1f1b-delay"]
        assert losses == pytest.approx(ref_losses, abs=TOL)
        for name, g in ref_grads.items():
            assert (grads[name] - g).abs().max().item() < TOL, name
    # the injector really delays: 1F1B's step crosses the link (2 ways) at least once per microbatch
    assert all(rank_out["1f1b"][2] > 2 * DELAY.seconds for rank_out in results)


def test_warmups_from_link_costs_and_simulated_gain():
    assert delay_warmups(4, None, 1.0) == [3, 2, 1, 0]
    assert delay_warmups(4, [0, 2.5, 0], 1.0) == [3 + 5, 2 + 5, 1, 0]
    with pytest.raises(ValueError, match="p-1=3"):
        delay_warmups(4, [1.0], 1.0)
    assert build_schedule("1f1b-delay", 4, 8) == build_schedule("1f1b", 4, 8)
    costs = Costs(F=1, B=1, W=1, link_latency=(0, 2.5, 0))
    plain = simulate(build_schedule("1f1b", 4, 8), costs).makespan
    aware = simulate(build_schedule("1f1b-delay", 4, 8, link_latency=[0, 2.5, 0], microbatch_time=3), costs)
    assert aware.makespan < plain
    # more microbatches in flight upstream of the slow link (ranks 0 and 1), as many downstream
    assert aware.peak_in_flight == [6, 5, 2, 1]  # warm-ups 3+2 and 2+2: ceil(2 * 2.5 / 3) = 2 more
    assert simulate(build_schedule("1f1b", 4, 8), costs).peak_in_flight == [4, 3, 2, 1]
    assert simulate(build_schedule("1f1b", 4, 8), Costs(F=1, B=1, W=1)).makespan == (8 + 3) * 3
    assert plain > (8 + 3) * 3 + 4 * 2.5 - 1e-9  # the slow link is on the critical path twice per round trip


def test_link_time():
    c = Costs(latency=0.5, link_latency=(0.0, 2.0), link_bandwidth=(10.0, 1.0), message_size=4.0)
    assert c.link_time(0, 1) == pytest.approx(0.5 + 0.4) and c.link_time(2, 1) == pytest.approx(0.5 + 2 + 4)
    assert c.link_time(2, 3) == 0.5


class _DoneWork:
    """A receive that has already arrived."""

    def wait(self):
        return True


def test_link_delay_counts_from_the_send_not_from_the_receive(monkeypatch):
    """The wait sleeps until the sender's stamp + the delay: a message sent long enough ago is not
    held at all (a late receive does not restart the latency), a fresh one for the delay."""
    assert DELAY.applies(1, 2) and DELAY.applies(2, 1) and not DELAY.applies(0, 1)
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    DELAY.delayed(_DoneWork(), _DoneWork(), DELAY.stamp() - 2 * DELAY.seconds).wait()
    assert slept == []
    DELAY.delayed(_DoneWork(), _DoneWork(), DELAY.stamp()).wait()
    assert len(slept) == 1 and 0 < slept[0] <= DELAY.seconds


def test_link_latency_config():
    from paratron.config import Config, ConfigError, apply_overrides
    from paratron.rules import validate
    from paratron.pipeline.delay import link_latency_seconds

    cfg = Config()
    apply_overrides(cfg, ["parallel.pipeline=4", "parallel.pipeline_link_latency_ms=[0, 40, 0]",
                          "model.num_layers=4"])
    with pytest.raises(ConfigError, match=r"parallel.pipeline_link_latency_ms only shape .*'1f1b' would ignore"):
        validate(cfg)  # the default schedule takes no link costs: they would be ignored silently
    cfg.parallel.schedule = "1f1b-delay"
    validate(cfg)
    assert link_latency_seconds(cfg.parallel) == (0.0, 0.04, 0.0)
    assert link_latency_seconds(Config().parallel) is None
    cfg.parallel.pipeline_link_latency_ms = [0.0, 40.0]
    with pytest.raises(ConfigError, match="parallel.pipeline_link_latency_ms"):
        validate(cfg)


def test_simulate_command_link_latency(capsys):
    from paratron.cli import main

    spans = {}
    for name in ("1f1b", "1f1b-delay"):
        assert main(["simulate", "--schedule", name, "--pipeline", "4", "--microbatches", "8",
                     "--link-latency", "0,2.5,0"]) == 0
        spans[name] = float(capsys.readouterr().out.split("makespan ")[1].split()[0])
    assert spans["1f1b-delay"] < spans["1f1b"]
    assert main(["simulate", "--pipeline", "4", "--link-latency", "0,1"]) == 2


@pytest.mark.parametrize("bad", [["--link-latency", "0,nan,0"], ["--link-latency", "0,inf,0"],
                                 ["--link-latency", "0,x,0"], ["--cost-f", "nan"], ["--cost-b", "inf"],
                                 ["--latency", "-1"], ["--comm-f", "-0.5"], ["--comm-f", "2"],
                                 ["--comm-b", "1.5"]])
def test_simulate_command_refuses_non_finite_or_negative_costs(bad, capsys):
    """A NaN/inf/negative time is refused naming the flag (it used to print NaN bubbles, accept a
    negative latency, or end 1f1b-delay in an OverflowError traceback), and so is an all-to-all
    time longer than the action it is part of."""
    from paratron.cli import main

    assert main(["simulate", "--schedule", "1f1b-delay", "--pipeline", "4", "--microbatches", "8", *bad]) == 2
    assert bad[0] in capsys.readouterr().err


def _delay_cfg(extra=()):
    from paratron.config import Config, apply_overrides
    from paratron.rules import validate

    cfg = Config()
    apply_overrides(cfg, ["parallel.pipeline=4", "parallel.schedule=1f1b-delay", "model.num_layers=4",
                          "parallel.pipeline_link_latency_ms=[0, 40, 0]", "train.micro_batch_size=1",
                          "train.global_batch_size=8", *extra])
    return validate(cfg, world_size=4)


def test_training_step_builds_1f1b_delay_from_the_configured_latencies():
    from types import SimpleNamespace

    from paratron.training.step import needs_microbatch_time, rank_actions

    aware = build_schedule("1f1b-delay", 4, 8, link_latency=[0, 0.04, 0], microbatch_time=0.02)
    assert aware != build_schedule("1f1b", 4, 8)
    configured, measured = _delay_cfg(["parallel.pipeline_microbatch_time_ms=20"]), _delay_cfg()
    assert not needs_microbatch_time(configured) and needs_microbatch_time(measured)
    for r in range(4):
        ctx = SimpleNamespace(pp=SimpleNamespace(size=4, rank=r))
        assert rank_actions(configured, ctx, 8) == aware[r]
        assert rank_actions(measured, ctx, 8) == build_schedule("1f1b", 4, 8)[r]  # until measured
        assert rank_actions(measured, ctx, 8, microbatch_time=0.02) == aware[r]


def test_microbatch_time_config_and_measurement():
    from paratron.config import ConfigError
    from paratron.pipeline.delay import measured_microbatch_time
    from paratron.pipeline.timeline import TraceEvent

    for bad in ("parallel.pipeline_microbatch_time_ms=0", "parallel.pipeline_link_latency_ms=[0, -1, 0]"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            _delay_cfg([bad])
    events = [TraceEvent(0, "F", 0, 0, 0.0, 0.1), TraceEvent(0, "SEND_F", 0, 0, 0.1, 0.5),
              TraceEvent(0, "F", 1, 0, 0.5, 0.6), TraceEvent(0, "BW", 0, 0, 0.6, 0.9),
              TraceEvent(0, "BW", 1, 0, 1, 1.3)]
    assert measured_microbatch_time(events, 2) == pytest.approx(0.4)


def _train_recording_actions(overrides, run_dir):
    """One rank of ``paratron train``; returns the action list each step ran."""
    import paratron.launch.runner as runner
    import paratron.training.trainer as trainer
    from paratron.rules import load_config

    real, seen = trainer.run_global_batch, []

    def recording(cfg, ctx, chunks, microbatches, *, forward_only, actions=None, **kw):
        if not forward_only:
            seen.append(list(actions))
        return real(cfg, ctx, chunks, microbatches, forward_only=forward_only, actions=actions, **kw)

    trainer.run_global_batch = recording  # this forked rank only
    assert runner.run_training(load_config(None, overrides), run_dir) == 0
    return seen


def test_paratron_train_measures_the_microbatch_time_and_rebuilds_1f1b_delay(tiny_corpus, tmp_path):
    """``paratron train`` with ``1f1b-delay``: step 1 runs 1F1B's warm-up and is measured; later
    steps run the link-aware lists (a 60 s link: every forward in flight before the first backward
    on rank 0, whatever the measured time)."""
    overrides = tiny_corpus + ["data.split=90,10,0", "model.num_layers=2", "model.hidden_size=32",
                               "model.num_attention_heads=4", "model.seq_length=16",
                               "model.make_vocab_size_divisible_by=16", "train.micro_batch_size=2",
                               "train.global_batch_size=8", "train.train_iters=2", "train.eval_interval=0",
                               "logging.tensorboard=false", "parallel.pipeline=2", "parallel.schedule=1f1b-delay",
                               "parallel.pipeline_link_latency_ms=[60000]"]
    steps = run_ranks(_train_recording_actions, 2, overrides, str(tmp_path), timeout=300)
    assert [s[0] for s in steps] == build_schedule("1f1b", 2, 4)
    assert [s[1] for s in steps] == build_schedule("1f1b-delay", 2, 4, link_latency=[60.0], microbatch_time=1.0)
    assert [a.kind for a in steps[0][1] if not a.is_p2p][:5] == ["F"] * 4 + ["BW"]
