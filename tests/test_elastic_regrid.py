"""Changing the pipeline degree of a running job (paratron/elastic/regrid.py, grow.py): PP=2 -> 4
with the spares called in after step 3 of 6, and PP=4 -> 2 with the last two stages leaving,
give the losses and final params of the uninterrupted PP=2 run bitwise (which PP=4 matches
too), at DP1, TP2 with sequence parallelism, DP2 and DP2 with ZeRO-1/2/3 (and PP=1 <-> 2 at DP2
ZeRO-1), write no file under the checkpoint directory, and the leavers exit 0 and are gone
before the job ends. Requests that cannot be met (a layout that does not fit, a grow without a free
slot) are refused and the run goes on unchanged."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from paratron.checkpoint.items import model_items
from paratron.checkpoint.manager import full_params
from paratron.elastic.relayout import RelayoutRefused, take_request_file, write_request
from paratron.elastic.regrid import plan_change
from paratron.launch.launch import alive
from paratron.local_ranks import run_ranks
from paratron.parallel.grid import build_grid
from paratron.rules import load_config
from paratron.training.callbacks import Callback

PLAN = "PARATRON_TEST_REGRID"  # json: {str(step): [layout, pipeline, how], ...}; how: "callback" or "file"

TINY = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.seq_length=16", "model.tie_embeddings=true", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_iters=6",
    "train.eval_interval=0", "train.deterministic=true", "train.seed=11",
    "optimizer.lr=3e-3", "optimizer.lr_warmup_iters=2", "optimizer.clip_grad=0.0",  # docs/elastic.md, "Bitwise parity"
    "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false",
    "train.sample_tokens=0", "train.elastic_relayout=true", "train.callbacks=test_elastic_regrid:Probe",
]


class Probe(Callback):
    """Asks for the requests of ``$PARATRON_TEST_REGRID`` through ``state.request_relayout`` or
    the file of ``paratron resize``,
    records the pipeline degree and the checkpoint directory's files at each step start, and at
    the end saves this rank's final params and whether the processes that left are still alive."""

    def __init__(self, state):
        self.plan = json.loads(os.environ.get(PLAN, "{}"))
        self.seen = []

    def on_step_start(self, state):
        ck = Path(state.run_dir) / "ck"
        self.seen.append({"iteration": state.iteration, "pipeline": state.config.parallel.pipeline,
                          "world": state.ctx.world_size,
                          "ck_files": sorted(str(p) for p in ck.rglob("*")) if ck.exists() else []})

    def on_step_end(self, state, metrics, timings):
        if str(state.iteration) in self.plan and state.ctx.rank == 0:
            layout, pipeline, how = self.plan[str(state.iteration)]
            if how == "file":
                write_request(state.run_dir, layout, pipeline)
            else:
                state.request_relayout(layout, pipeline=pipeline)

    def on_train_end(self, state):
        with full_params(state.optimizer):  # ZeRO-3: the params are gathered for the block
            items = model_items(state.chunks, is_first_stage=state.ctx.is_first_stage)
            # keyed by the chunk's place in the full tensor too: TP ranks hold other chunks
            params = {(k, c.offsets): c.tensor.clone() for k, chunks in items.items() for c in chunks}
        pids = {p.name: alive(int(p.read_text())) for p in Path(state.run_dir).glob("slot_*.pid")}
        torch.save({"params": params, "seen": self.seen, "alive": pids},
                   Path(state.run_dir) / f"probe_{state.ctx.rank}.pt")


def _train(overrides: list[str], run_dir: str, plan: dict) -> int:
    import paratron.launch.runner as runner

    os.environ[PLAN] = json.dumps(plan)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / f"slot_{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    return runner.run_training(load_config(None, overrides), run_dir)


def _run(tmp_path, name, overrides, plan=None, launch=2, final_world=None):
    run_dir = tmp_path / name
    assert run_ranks(_train, launch, overrides, str(run_dir), plan or {}, timeout=900) == [0] * launch
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    probes = [torch.load(run_dir / f"probe_{r}.pt") for r in range(final_world or launch)]
    params = {k: v for p in probes for k, v in p["params"].items()}
    return losses, params, probes


def _assert_same(a, b, what):
    assert sorted(a[0]) == [1, 2, 3, 4, 5, 6]
    assert a[0] == b[0], f"{what}: losses {a[0]} vs {b[0]}"
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{what}: {k}"


# The grids of the changes, each [DP x TP] fixed with PP=2 <-> PP=4; each pair is (extra overrides,
# ranks per pipeline stage). TP2 with sequence parallelism: TP-sharded rectangles, replicated
# norms, the vocab padded per TP rank; DP2: a stage's data shards, the DP replicas as sources;
# DP2 with ZeRO-1/2/3: the DP partition of the flat buckets changes with the layers a stage holds
# (ZeRO-3: the params move as the shards of the main weights).
GRIDS = {
    "dp1": ([], 1),
    "tp2-sp": (["parallel.tensor=2", "parallel.sequence_parallel=true"], 2),
    "dp2": (["parallel.zero=0"], 2),
    "dp2-zero1": (["parallel.zero=1"], 2),
    "dp2-zero2": (["parallel.zero=2"], 2),
    "dp2-zero3": (["parallel.zero=3"], 2),
    "dp2-zero3-keep": (["parallel.zero=3", "parallel.zero3_reshard_after_forward=false"], 2),
}
SLOW = pytest.mark.slow  # 8 processes: over a minute on 2 cores


def _grids(*fast):
    return [pytest.param(g, id=g, marks=() if g in fast else SLOW) for g in GRIDS]


@pytest.fixture(scope="module")
def uninterrupted(tiny_corpus, tmp_path_factory):
    """``uninterrupted(grid)``: the uninterrupted PP=2 run of a grid of :data:`GRIDS` that each
    change at that grid is compared with, run once per module."""
    runs = {}

    def run(grid):
        if grid not in runs:
            extra, per_stage = GRIDS[grid]
            runs[grid] = _run(tmp_path_factory.mktemp(f"pp2-{grid}"), "run",
                              TINY + tiny_corpus + ["data.split=100,0,0", "parallel.pipeline=2", *extra],
                              launch=2 * per_stage)
        return runs[grid]
    return run


def _pipelines(probe) -> dict:
    return {s["iteration"]: (s["pipeline"], s["world"]) for s in probe["seen"]}


@pytest.mark.parametrize("grid", _grids("dp1"))
def test_grow_pp2_to_pp4_in_memory_is_bitwise(uninterrupted, tiny_corpus, tmp_path, grid):
    """Twice the ranks, half of them spares: after step 1 a layout that does not fit is refused,
    after step 3 the spares join as stages 2 and 3."""
    extra, per_stage = GRIDS[grid]
    base = TINY + tiny_corpus + ["data.split=100,0,0", *extra]
    ck = tmp_path / "grow" / "ck"
    grow = _run(tmp_path, "grow", base + ["parallel.pipeline=2", f"train.elastic_spares={2 * per_stage}",
                                          f"checkpoint.save={ck}"],
                {"1": [[1, 1, 1, 2], 4, "callback"], "3": [None, 4, "callback"]}, launch=4 * per_stage)
    _assert_same(uninterrupted(grid), grow, "PP=2 -> PP=4 after step 3")
    before, after = 2 * per_stage, 4 * per_stage
    survivor, newcomer = _pipelines(grow[2][0]), _pipelines(grow[2][-1])
    assert survivor == {0: (2, before), 1: (2, before), 2: (2, before), 3: (4, after), 4: (4, after),
                        5: (4, after)}, survivor
    assert newcomer == {3: (4, after), 4: (4, after), 5: (4, after)}, newcomer  # joined for steps 4-6
    assert all(s["ck_files"] == [] for p in grow[2] for s in p["seen"])  # nothing written by the change
    assert (ck / "latest").read_text().strip() == "step_6"  # the final save, at PP=4


@pytest.mark.slow
def test_uninterrupted_pp4_equals_pp2(uninterrupted, tiny_corpus, tmp_path):
    """The premise of the bitwise tests: the pipeline degree alone does not change the math."""
    pp4 = _run(tmp_path, "pp4", TINY + tiny_corpus + ["data.split=100,0,0", "parallel.pipeline=4"], launch=4)
    _assert_same(uninterrupted("dp1"), pp4, "PP=4 vs PP=2 uninterrupted")


@pytest.mark.parametrize("grid", _grids("dp1"))
def test_shrink_pp4_to_pp2_in_memory_is_bitwise(uninterrupted, tiny_corpus, tmp_path, grid):
    """After step 2 a grow with no free slot is refused; after step 3 stages 2 and 3 hand over
    and leave: their processes return 0 (run_ranks checks each) and are gone at the end."""
    extra, per_stage = GRIDS[grid]
    base = TINY + tiny_corpus + ["data.split=100,0,0", *extra]
    before, after = 4 * per_stage, 2 * per_stage
    shrink = _run(tmp_path, "shrink", base + ["parallel.pipeline=4"], {"2": [None, 8, "callback"], "3": [None, 2, "file"]},
                  launch=before, final_world=after)
    _assert_same(uninterrupted(grid), shrink, "PP=4 -> PP=2 after step 3")
    assert _pipelines(shrink[2][0]) == {0: (4, before), 1: (4, before), 2: (4, before), 3: (2, after),
                                        4: (2, after), 5: (2, after)}
    # the leavers (stages 2 and 3: the last ranks, pp is the slowest axis of the default order)
    # are gone when rank 0 ends; a survivor may have exited already too, so only the leavers count
    alive = shrink[2][0]["alive"]
    assert sorted(alive) == sorted(f"slot_{r}.pid" for r in range(before))
    assert not any(alive[f"slot_{r}.pid"] for r in range(after, before)), alive
    assert all(s["ck_files"] == [] for p in shrink[2] for s in p["seen"])  # nothing written by the change
    assert not (tmp_path / "shrink" / f"probe_{after}.pt").exists()  # the leavers did not train to the end
    assert not (tmp_path / "shrink" / "relayout_request.json").exists()  # the file's request was taken


# DP2 x ZeRO-1 at 2 -> 4 processes: pipelining switched on (PP=1 -> 2) and off again. Untied
# embeddings: at PP=1 the tied weight is one tensor whose two grads add inside autograd, at PP=2
# two copies whose grads add over the embedding group, which rounds differently (measured: the
# final params of uninterrupted PP=1 and PP=2 differ, docs/elastic.md).
ZERO1_SMALL = TINY + ["parallel.zero=1", "model.tie_embeddings=false", "data.split=100,0,0"]


@pytest.mark.parametrize("start, to", [(1, 2), pytest.param(2, 1, marks=SLOW)], ids=["grow-pp1-pp2", "shrink-pp2-pp1"])
def test_zero1_change_to_and_from_one_stage_is_bitwise(tiny_corpus, tmp_path, start, to):
    """DP2 with ZeRO-1: after step 3 the pipeline degree goes from ``start`` to ``to`` (a grow
    calls in the 2 spares as stage 1; a shrink lets stage 1 leave); the losses and final params
    equal the uninterrupted run at ``start`` bitwise, and nothing is written under the checkpoint
    directory by the change."""
    base = ZERO1_SMALL + tiny_corpus
    first, last = 2 * start, 2 * to
    ref = _run(tmp_path, "ref", base + [f"parallel.pipeline={start}"], launch=first)
    ck = tmp_path / "changed" / "ck"
    spares = [f"train.elastic_spares={last - first}"] if to > start else []
    changed = _run(tmp_path, "changed", base + [f"parallel.pipeline={start}", f"checkpoint.save={ck}", *spares],
                   {"3": [None, to, "callback"]}, launch=max(first, last), final_world=last)
    _assert_same(ref, changed, f"PP={start} -> PP={to} after step 3 at DP2 ZeRO-1")
    assert _pipelines(changed[2][0]) == {0: (start, first), 1: (start, first), 2: (start, first), 3: (to, last),
                                         4: (to, last), 5: (to, last)}
    assert all(s["ck_files"] == [] for p in changed[2] for s in p["seen"])  # nothing written by the change
    alive = changed[2][0]["alive"]
    assert not any(alive[f"slot_{r}.pid"] for r in range(last, first)), alive  # the leavers are gone


def _cfg(*extra):
    return load_config(None, ["model.num_layers=4", "parallel.pipeline=2", "train.elastic_relayout=true", *extra])


def test_plan_change_keeps_coordinates_and_refuses_what_cannot_be_met():
    grid = build_grid(4, pp=2)  # dp=2
    grow = plan_change(_cfg(), grid, 4, None, spares=[4, 5, 6, 7])
    assert grow.new_rank == (0, 1, 2, 3) and grow.newcomers == ((4, 4), (5, 5), (6, 6), (7, 7))
    assert grow.union_size == 8 and grow.stages() == [0, 0, 1, 1, 2, 2, 3, 3]
    shrink = plan_change(_cfg("parallel.pipeline=4"), build_grid(8, pp=4), 2, [3, 1], spares=[])
    assert shrink.new_rank == (0, 1, 2, 3, None, None, None, None) and shrink.newcomers == ()
    assert shrink.stages() == [0, 0, 1, 1, 2, 2, 3, 3]
    with pytest.raises(RelayoutRefused, match=r"needs 4 more processes and 3 stand by \(no free slot"):
        plan_change(_cfg(), grid, 4, None, spares=[4, 5, 6])
    with pytest.raises(RelayoutRefused, match="sum to model.num_layers=4"):
        plan_change(_cfg(), grid, 4, [1, 1, 1, 2], spares=[4, 5, 6, 7])
    with pytest.raises(RelayoutRefused, match=r"parallel.pipeline=3 pipeline_layout=None \(the even split of "
                       r"model.num_layers=4 over parallel.pipeline\*virtual_pipeline = 3 stages\) refused"):
        plan_change(_cfg(), grid, 3, None, spares=[4, 5, 6, 7])  # None names the split it means
    with pytest.raises(RelayoutRefused, match=r"parallel.pipeline=4 pipeline_layout=None \(the even split "
                       r"\[1, 1, 1, 1\]\) refused: it needs 4 more"):
        plan_change(_cfg(), grid, 4, None, spares=[])
    assert plan_change(_cfg("parallel.zero=3"), grid, 4, None, spares=[4, 5, 6, 7]).grow  # ZeRO-2/3 too


def test_resize_command_asks_for_a_new_pipeline_degree(tmp_path, capsys):
    from paratron.cli import main
    from paratron.launch.runlock import RunLock
    from paratron.config import to_toml

    (tmp_path / "config.toml").write_text(to_toml(_cfg()), encoding="utf-8")
    assert main(["resize", str(tmp_path), "--pipeline", "4", "--layout", "1,1,1,2"]) == 2
    assert "sum to model.num_layers=4" in capsys.readouterr().out
    assert main(["resize", str(tmp_path), "--pipeline", "2"]) == 2  # nothing would change
    assert not (tmp_path / "relayout_request.json").exists()
    assert main(["resize", str(tmp_path), "--pipeline", "4"]) == 2  # no job holds the run directory
    assert "no job is running" in capsys.readouterr().out and not (tmp_path / "relayout_request.json").exists()
    with RunLock(tmp_path):
        assert main(["resize", str(tmp_path), "--pipeline", "4", "--wait", "0"]) == 0
    assert "parallel.pipeline=4 pipeline_layout=None" in capsys.readouterr().out
    taken = take_request_file(tmp_path, 0)
    assert taken.pop("id") and taken == {"layout": None, "pipeline": 4}


def _spare_stopped() -> None:
    """In a child process: a spare standing by gets SIGTERM; exit 0 when it left with exit 0 and
    its handlers were put back, 1 otherwise."""
    import os
    import signal
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from paratron.launch.grow import stand_by

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    session = SimpleNamespace(store=store, slot=0)
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        stand_by(session, None, None)
        code = None
    except SystemExit as ended:
        code = ended.code
    timer.join()
    os._exit(0 if code == 0 and signal.getsignal(signal.SIGTERM) is before else 1)


def test_a_spare_standing_by_leaves_with_exit_0_on_a_stop_signal():
    """A spare standing by (no state, no process group) died of the SIGTERM the launcher sends
    every rank on a stop, and torchrun reported the stopped job as failed; it now leaves with
    exit 0, and a spare called in keeps the handlers it had. In a child process: the store and
    the threads of a spare left in the test process made the ranks forked by later tests hang."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_spare_stopped)
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0, f"the spare ended with {child.exitcode} (None: still running)"


@pytest.mark.parametrize("overrides, world, says", [
    (["train.elastic_spares=2"], 4, "train.elastic_spares=2 needs train.elastic_relayout=true"),
    (["train.elastic_spares=-1"], 4, "train.elastic_spares=-1 must be >= 0"),
    (["train.elastic_spares=3", "train.elastic_relayout=true", "parallel.pipeline=2"], 4,
     "(world size 1: the launch's 4 ranks less train.elastic_spares=3)"),
])
def test_spare_rules_name_the_rule_that_is_broken(overrides, world, says):
    """One message had said "must be >= 0, and needs train.elastic_relayout=true" for either
    fault, and a layout error at the training world did not say that the spares were taken off."""
    from paratron.config import ConfigError
    from paratron.rules import build_config, validate

    with pytest.raises(ConfigError) as e:
        validate(build_config(None, overrides), world)
    assert says in str(e.value), str(e.value)
