"""``paratron plan``: enumeration through the validator, the cost terms against their closed forms
and against what paratron really saves and sends, refusals of bad input, and the top CPU plan
trained for 2 steps."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from paratron.config import Config, ModelConfig
from paratron.rules import load_config, validate
from paratron.planner import memory as planner_memory
from paratron.dryrun.plan_command import add_arguments, run as plan_run
from paratron.planner.compute import Work
from paratron.planner.estimate import Problem, estimate
from paratron.planner.hardware import Cluster, device
from paratron.planner.layout import Layout, to_config
from paratron.planner.layouts import enumerate_layouts
from paratron.planner.pipeline import ScheduleCache, makespan
from paratron.planner.search import PlanError, plan
from paratron.planner.shape import Shape
from paratron.local_ranks import run_ranks

ROOT = Path(__file__).resolve().parents[1]
# Fixed CPU figures (not measured, so that the ranking in these tests is deterministic).
CAL = {"gemm_flops": 2e10, "nproc": 4, "cores": 2, "mem_bandwidth": 5e9, "op_overhead": 2e-5,
       "gloo_bandwidth": 1e9, "gloo_latency": 2e-4}
TINY_MODEL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
                  normalization="rmsnorm", position_embedding_type="rope", activation="swiglu",
                  add_bias_linear=False, tie_embeddings=True, make_vocab_size_divisible_by=16, vocab_size=512)


def _problem(cfg: Config, world: int = 4, gpu: str = "cpu", gbs: int = 8, memory_gb=None) -> Problem:
    model = cfg.model
    hw = device(gpu, calibration=CAL if gpu == "cpu" else None, memory_gb=memory_gb)
    return Problem(model, Shape.of(model, model.seq_length), Cluster(1, world, hw), gbs, model.seq_length)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


# ---- enumeration asks the validator ---------------------------------------------------------
def test_every_layout_is_one_the_validator_accepts(monkeypatch):
    cfg = Config(model=ModelConfig(**TINY_MODEL))
    layouts, refused = enumerate_layouts(cfg, 4, 4, 16, "fp32")
    assert layouts and refused
    for lay in layouts[::29]:
        validate(to_config(cfg, lay, 4, 16, "fp32"), 4)
    # ZeRO levels and context parallelism appear exactly as far as the validator accepts them.
    zeros = {lay.zero for lay in layouts}
    for z in (0, 1, 2, 3):
        probe = to_config(cfg, layouts[0], 4, 16, "fp32")
        probe.parallel.zero = z
        try:
            validate(probe, 4)
            ok = True
        except ValueError:
            ok = False
        assert (z in zeros) == ok
    # A validator that refuses pipeline parallelism removes every pp > 1 layout.
    import paratron.planner.layouts as mod

    def no_pp(c, world):
        if c.parallel.pipeline > 1:
            raise mod.ConfigError("parallel.pipeline must be 1 here")

    monkeypatch.setattr(mod, "VALIDATORS", [*mod.VALIDATORS, no_pp])
    assert {lay.pp for lay in enumerate_layouts(cfg, 4, 4, 16, "fp32")[0]} == {1}


def test_rules_run_once_on_the_base_change_no_layout(monkeypatch):
    """``_finite`` (the layout-free rule) runs once on the base config: the layouts and refusals
    are those of running every rule on every layout; a base that fails it still runs it each time."""
    import paratron.planner.layouts as mod

    cfg = Config(model=ModelConfig(**TINY_MODEL))
    assert mod._passed_once(cfg, 8) == ("_finite",)
    fast = enumerate_layouts(cfg, 8, 8, 16, "fp32")
    monkeypatch.setattr(mod, "LAYOUT_FREE_RULES", ())
    assert enumerate_layouts(cfg, 8, 8, 16, "fp32") == fast
    cfg.optimizer.lr = float("nan")
    monkeypatch.undo()
    assert mod._passed_once(cfg, 8) == ()
    layouts, refused = enumerate_layouts(cfg, 8, 8, 16, "fp32")
    assert not layouts and any("optimizer.lr=nan" in rule for rule in refused)


# ---- cost terms -------------------------------------------------------------------------------
def test_pipeline_term_is_the_simulated_schedule():
    # Uniform stages, no latency: 1F1B's bubble is (p-1)/(m+p-1) (Narayanan et al. 2021, section 2.2)
    # and rank r keeps p - r microbatches in flight.
    cache = ScheduleCache()
    p, m = 4, 8
    cost = makespan(cache.lists("1f1b", p, m, 1), [Work(1.0, 1.0, 1.0)] * p, 0.0)
    assert cost.makespan == pytest.approx((m + p - 1) * 3.0)
    assert cost.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert cache.in_flight("1f1b", p, m, 1) == [4, 3, 2, 1]
    assert cache.in_flight("gpipe", p, m, 1) == [m] * p
    # Without a separate W, a rank's only peak point holds no pending weight grad.
    assert cache.flight("1f1b", p, m, 1) == [((4, 0),), ((3, 0),), ((2, 0),), ((1, 0),)]


def test_zero_bubble_flight_counts_pending_weight_grads():
    """ZB-H1 (Qi et al. 2023): a microbatch is alive from its F to its B, then its W is pending
    until the W; the (alive, pending) points each rank reaches, and their sum is the count of
    a microbatch kept until its W (``in_flight``)."""
    cache = ScheduleCache()
    flights = cache.flight("zb-h1", 4, 8, 1)
    assert [max(a for a, _ in f) for f in flights] == [4, 3, 2, 1]
    assert all(max(w for _, w in f) >= 1 for f in flights)
    assert cache.in_flight("zb-h1", 4, 8, 1) == [max(a + w for a, w in f) for f in flights]
    for f in flights:  # no point dominates another
        assert not any(o != q and o[0] >= q[0] and o[1] >= q[1] for o in f for q in f)


def test_memory_model_against_zero_levels():
    lay = Layout(1, 1, 1, 4, 1, 1, 0, "1f1b", 1, "none", False)
    assert planner_memory.state_bytes(1000, lay, "bf16") == (2000, 4000, 12000)
    z1 = dataclasses.replace(lay, zero=1)
    # ZeRO-1: the full grad buffer plus its reduced fp32 shard (measured by paratron dryrun)
    assert planner_memory.state_bytes(1000, z1, "bf16") == (2000, 5000, 3000)
    z3 = dataclasses.replace(lay, zero=3)
    assert planner_memory.state_bytes(1000, z3, "fp32") == (1000, 1000, 2000)


def _saved_activation_bytes(cfg: ModelConfig, b: int) -> int:
    """Bytes of the tensors autograd saves for one forward of a 1-chunk model (params excluded)."""
    from paratron.models.gpt import build_model_chunks
    from paratron.parallel.context import ParallelContext

    chunk = build_model_chunks(cfg, ParallelContext.single(), seed=1)[0]
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    live: dict[int, list[int]] = {}
    total = [0]

    class Held:
        def __init__(self, t):
            self.t, self.key = t, t.untyped_storage().data_ptr()
            if self.key in params:
                self.key = None
            elif self.key in live:
                live[self.key][1] += 1
            else:
                live[self.key] = [t.untyped_storage().nbytes(), 1]
                total[0] += live[self.key][0]

    x = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length))
    with torch.autograd.graph.saved_tensors_hooks(Held, lambda h: h.t):
        chunk(x, x)
        return total[0]


@pytest.mark.parametrize("activation,pos", [("gelu", "learned"), ("swiglu", "rope")])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_formula_matches_saved_tensors(activation, pos, recompute):
    """Per layer, the Korthikanti-style inventory matches what autograd really keeps within 10% (the
    copies SDPA and RoPE keep depend on the backend and on contiguity, which the formula averages)."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=32,
                      vocab_size=256, activation=activation, position_embedding_type=pos, recompute=recompute)
    two = _saved_activation_bytes(cfg, 2)
    four = _saved_activation_bytes(dataclasses.replace(cfg, num_layers=4), 2)
    lay = Layout(1, 1, 1, 1, 1, 1, 0, "1f1b", 2, recompute, False)
    predicted, _ = planner_memory.layer_activation_bytes(Shape.of(cfg, 32), lay, 2, 4, True)
    assert predicted == pytest.approx((four - two) / 2, rel=0.10)


# ---- the plan and its runnability -------------------------------------------------------------
def test_cpu_plans_are_accepted_by_train_validation(tmp_path):
    from paratron.launch.command import load_and_validate

    cfg = Config(model=ModelConfig(**TINY_MODEL))
    cfg.train.global_batch_size = 8
    prob = _problem(cfg)
    result = plan(prob, cfg, top_k=8)
    assert len(result.plans) == 8
    times = [e.step_time for e in result.plans]
    assert times == sorted(times)
    for e in result.plans:
        path = tmp_path / "p.toml"
        from paratron.planner.report import plan_toml

        path.write_text(plan_toml(cfg, e, prob, "test"))
        ns = argparse.Namespace(config=str(path), overrides=[], nproc_per_node=4, nnodes="1")
        got = load_and_validate(ns)
        assert (got.parallel.tensor, got.parallel.pipeline, got.train.micro_batch_size) == (
            e.layout.tp, e.layout.pp, e.layout.mbs)


def _train_in_rank(argv):
    from paratron.cli import main

    return main(argv)


def test_top_cpu_plan_trains_two_steps(tmp_path, tiny_corpus, capsys):
    base = tmp_path / "base.toml"
    lines = ["[model]"] + [f"{k} = {json.dumps(v)}" for k, v in TINY_MODEL.items() if k != "vocab_size"]
    lines += ["[train]", "global_batch_size = 8", "train_iters = 2", "eval_interval = 0",
              "[logging]", "tensorboard = false"]
    base.write_text("\n".join(lines).replace("true", "true") + "\n")
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CAL))
    out = tmp_path / "plan.toml"
    overrides = tiny_corpus + ["data.split=90,10,0"]
    argv = ["--config", str(base), "--gpu", "cpu", "--gpus-per-node", "4", "--calibration", str(cal),
            "--output", str(out), "--explain"]
    for o in overrides:
        argv += ["--set", o]
    assert plan_run(_args(*argv)) == 0
    printed = capsys.readouterr().out
    assert "step time" in printed and "memory on pipeline rank" in printed
    run_dir = tmp_path / "run"
    codes = run_ranks(_train_in_rank, 4, ["train", "--config", str(out), "--run-dir", str(run_dir)], timeout=300)
    assert codes == [0] * 4
    losses = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in losses if "loss" in r] == [1, 2]


# ---- bad input ----------------------------------------------------------------------------------
def test_unknown_gpu_is_refused(capsys):
    assert plan_run(_args("--gpu", "v100")) == 2
    err = capsys.readouterr().err
    assert "--gpu='v100' is not a known device type" in err and "h100" in err and "cpu" in err


def test_zero_gpus_per_node_is_refused(capsys):
    # 0 is falsy: it must not fall back to the default of 8 devices per node.
    assert plan_run(_args("--gpu", "h100", "--gpus-per-node", "0")) == 2
    assert "--gpus-per-node=0 must be a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--global-batch-size", "--seq-length"])
def test_zero_batch_or_sequence_is_refused(flag, capsys):
    # Same falsy trap: 0 planned silently for the config's batch / sequence length.
    assert plan_run(_args("--gpu", "h100", flag, "0")) == 2
    assert f"{flag}=0 must be a positive integer" in capsys.readouterr().err


def test_global_batch_no_layout_can_split():
    # One layer, one head, an odd sequence: tp = pp = cp = 1, so dp = 4 must divide the batch.
    cfg = Config(model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=1, seq_length=15,
                                   vocab_size=128))
    with pytest.raises(PlanError, match=r"train.global_batch_size=6 is not divisible by train.micro_batch_size\*dp"):
        plan(_problem(cfg, gbs=6), cfg)


def test_model_that_fits_nowhere_names_the_memory_it_needs():
    cfg = Config(model=ModelConfig(**TINY_MODEL))
    with pytest.raises(PlanError, match=r"smallest memory per rank any layout needs is \d+\.\d\d kB") as e:
        plan(_problem(cfg, memory_gb=1e-4), cfg)
    assert "more than the device memory 100.00 kB (--memory-gb)" in str(e.value)
    # The memory named is what the planner predicts for its leanest layout: with that much, it fits.
    need = float(str(e.value).split("needs is ")[1].split(" kB")[0]) * 1e3
    assert plan(_problem(cfg, memory_gb=need * 1.01 / 1e9), cfg).plans


# ---- the communication term against the ledger ---------------------------------------------------
def _ledger_rank(sp: bool):
    from paratron.models.gpt import build_model_chunks
    from paratron.parallel.context import ParallelContext

    cfg = ModelConfig(**{**TINY_MODEL, "num_layers": 2})
    ctx = ParallelContext.build(tp=2)
    chunk = build_model_chunks(cfg, ctx, seed=1, sequence_parallel=sp)[0]
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    with ctx.ledger.recording():
        loss = chunk(x, x).sum()
        fwd = ctx.ledger.summary()
    with ctx.ledger.recording():
        loss.backward()
        bwd = ctx.ledger.summary()
    return fwd, bwd


def _planned(sp: bool, backward: bool) -> dict:
    from paratron.planner import communication as comm

    cfg = ModelConfig(**{**TINY_MODEL, "num_layers": 2})
    shape, lay = Shape.of(cfg, cfg.seq_length), Layout(2, 1, 1, 1, 1, 1, 0, "1f1b", 2, "none", sp)
    transfers = comm.tp_layer(shape, lay, 2, 4, backward) * cfg.num_layers
    transfers += comm.embedding_and_head(shape, lay, 2, 4, True, True, backward)
    out: dict = {}
    for t in transfers:
        e = out.setdefault(f"{t.op}@{t.group}", {"calls": 0, "bytes": 0})
        e["calls"] += t.calls
        e["bytes"] += int(t.nbytes * t.calls)
    return out


@pytest.mark.parametrize("sp", [False, True])
def test_communication_bytes_are_the_ledgers(sp):
    """The planner's TP volumes of a 2-layer model (embedding and loss included) are exactly what
    the comm ledger records for one microbatch's forward and backward on 2 ranks."""
    fwd, bwd = run_ranks(_ledger_rank, 2, sp, timeout=180)[0]
    assert _planned(sp, False) == fwd
    assert _planned(sp, True) == bwd


# ---- Megatron SC21 table 1 --------------------------------------------------------------------
@pytest.mark.parametrize("row", [0, 4])
def test_published_megatron_layout_within_25_percent(row):
    """The planner's TFLOP/s per GPU for a published layout of Narayanan et al. 2021, table 1, is
    within 25% of the published figure, in 80 GB (all rows, and the planner's own best plans:
    benchmarks/bench_planner_megatron.py, recorded in benchmarks/README.md)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_planner_megatron as megatron

    r = megatron.rows()[row]
    prob, _ = megatron.problem(r)
    e = estimate(prob, megatron.published_layout(r), ScheduleCache())
    assert e.hw_tflops_per_device == pytest.approx(float(r["achieved_tflops_per_gpu"]), rel=0.25)
    assert e.memory.total <= 80e9
