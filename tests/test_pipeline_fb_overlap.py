"""Cross-microbatch F/B overlap: ``FB`` pairs in action lists.

Lists: :func:`overlap_fb` keeps every schedule valid and the same work; the validator rejects
malformed pairs; the simulator's makespan drops when the all-to-all cost is nonzero.
Runtime: a tiny MoE GPT (4 experts, top-2, MoE in every layer) trained 3 steps with SGD under
the overlapped list matches the plain list at the same layout to 1e-6 (fp32): one process
(1F1B, ZB-H1 with split backward, full recompute), EP=2, EP=2 x TP=2 (with and without SP),
EP=2 x PP=2 (1F1B, interleaved; zbv and EP=2 x TP=2 x PP=2 are slow); at EP=2 x PP=2 the
recorded timeline holds a dispatch all-to-all of one microbatch inside the backward of another.
"""

from __future__ import annotations

import pytest
import torch

from paratron.config import Config
from paratron.rules import validate as validate_config
from paratron.parallel.context import ParallelContext
from paratron.pipeline.actions import BW, FB, Action, F, expand, forward_only
from paratron.pipeline.overlap import overlap_fb
from paratron.pipeline.registry import build_schedule
from paratron.pipeline.schedules import with_p2p
from paratron.pipeline.simulator import Costs, simulate
from paratron.pipeline.validate import ScheduleError, validate
from paratron.local_ranks import run_ranks

COMM = Costs(F=1.0, B=1.0, W=1.0, comm_F=0.5, comm_B=0.5)
GBS, SEQ, VOCAB, LR, STEPS, TOL = 4, 8, 32, 0.5, 3, 1e-6


# ---- lists -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,p,m,v", [("1f1b", 1, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                        ("zb-h1", 4, 8, 1), ("interleaved", 2, 4, 2), ("zbv", 2, 4, 2),
                                        ("gpipe", 2, 4, 1)])
def test_overlap_keeps_work_and_validity(name, p, m, v):
    plain = build_schedule(name, p, m, v)
    for costs in (COMM, Costs()):
        lists = overlap_fb(plain, costs)
        validate(lists, m)
        assert any(a.kind == "FB" for acts in lists for a in acts), f"{name}: no pair formed"
        for before, after in zip(plain, lists):  # the same compute, some of it fused
            assert sorted(map(str, expand([a for a in after if not a.is_p2p]))) == \
                sorted(str(a) for a in before if not a.is_p2p)
        assert simulate(lists, costs).makespan <= simulate(plain, costs).makespan
        validate([forward_only(acts) for acts in lists], m, forward_only=True)  # evaluation runs the F halves


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 1, 4, 1), ("1f1b", 2, 4, 1), ("zb-h1", 4, 8, 1),
                                        ("interleaved", 2, 4, 2)])
def test_simulated_step_is_shorter_with_comm(name, p, m, v):
    plain = build_schedule(name, p, m, v)
    lists = overlap_fb(plain, COMM)
    assert simulate(lists, COMM).makespan < simulate(plain, COMM).makespan
    # Without all-to-all time a pair costs its two halves in a row: nothing to gain.
    assert simulate(lists, Costs()).makespan >= simulate(plain, Costs()).makespan


def test_config_rule_and_megatron_switch():
    from paratron.config import ConfigError
    from paratron.config.aliases import MEGATRON_SWITCHES

    assert MEGATRON_SWITCHES["--overlap-moe-expert-parallel-comm"][0] == "parallel.overlap_moe_expert_parallel_comm"
    cfg = _config()
    cfg.parallel.overlap_moe_expert_parallel_comm = True
    validate_config(cfg, 1)
    cfg.parallel.zero = 3
    with pytest.raises(ConfigError, match="parallel.zero=3 frees"):
        validate_config(cfg, 1)
    cfg.parallel.zero = 0
    cfg.model.moe_token_dispatcher = "alltoall_chunked"
    with pytest.raises(ConfigError, match="moe_token_dispatcher='alltoall_chunked' does not"):
        validate_config(cfg, 1)
    cfg.model.num_experts = 0
    with pytest.raises(ConfigError, match="num_experts=0 has none"):
        validate_config(cfg, 1)


def test_memory_budget_and_simulate_command(capsys):
    from paratron.cli import main
    from paratron.pipeline.actions import activation_peak

    plain = build_schedule("zb-h1", 4, 8)
    free = overlap_fb(plain, COMM)
    assert max(activation_peak(acts) for acts in free) == 5  # a pair holds both halves' activations
    bounded = overlap_fb(plain, COMM, memory_budget=4)
    assert max(activation_peak(acts) for acts in bounded) == 4
    assert any(a.kind == "FB" for acts in bounded for a in acts)
    assert main(["simulate", "--schedule", "zb-h1", "--pipeline", "4", "--microbatches", "8", "--comm-f", "0.5",
                 "--comm-b", "0.5", "--overlap-fb"]) == 0
    out = capsys.readouterr().out
    assert "without FB pairs: makespan 27" in out and "makespan 23" in out


def test_pair_cost_rule():
    c = Costs(F=1.0, B=2.0, W=1.0, comm_F=0.25, comm_B=0.5)
    assert c(FB(F(1, 0), BW(0, 0))) == pytest.approx(1.0 + 3.0 - 0.75)
    assert c(FB(F(1, 0), Action("B", 0, 0))) == pytest.approx(1.0 + 2.0 - 0.75)
    heavy = Costs(F=1.0, B=1.0, comm_F=0.9, comm_B=0.9)  # the exchanges outlast the compute
    assert heavy(FB(F(1, 0), Action("B", 0, 0))) == pytest.approx(1.8)


def test_validator_rejects_malformed_pairs():
    one = [[F(0, 0), BW(0, 0), F(1, 0), BW(1, 0)]]
    validate([[F(0, 0), FB(F(1, 0), BW(0, 0)), BW(1, 0)]])
    with pytest.raises(ScheduleError, match="backward before its forward"):  # B paired before its F
        validate([[FB(F(1, 0), BW(0, 0)), F(0, 0), BW(1, 0)]])
    with pytest.raises(ScheduleError, match="two independent halves"):
        validate([[FB(F(0, 0), BW(0, 0)), F(1, 0), BW(1, 0)]])
    with pytest.raises(ScheduleError, match="duplicate"):
        validate([[F(0, 0), FB(F(1, 0), BW(0, 0)), BW(0, 0)] + one[0][3:]])
    # Across ranks: the pair on rank 1 waits for the grad of microbatch 0 from rank 2, which needs
    # F(0) on stage 1 first: a pair whose backward half waits on its own rank's later work.
    plain = build_schedule("1f1b", 2, 2)
    compute = [[a for a in acts if not a.is_p2p] for acts in plain]
    compute[1] = [FB(F(0, 1), BW(1, 1)), F(1, 1), BW(0, 1)]
    with pytest.raises(ScheduleError, match="backward before its forward"):
        validate(with_p2p(compute))
    with pytest.raises(ValueError, match="partner"):
        Action("FB", 0, 0)


def test_with_p2p_receives_before_and_sends_after_a_pair():
    compute = [[F(0, 0), F(1, 0), FB(F(2, 0), BW(0, 0)), BW(1, 0), BW(2, 0)],
               [F(0, 1), FB(F(1, 1), BW(0, 1)), BW(1, 1), F(2, 1), BW(2, 1)]]
    lists = with_p2p(compute)
    validate(lists)
    r1 = [str(a) for a in lists[1]]
    k = r1.index("F1@s1+BW0@s1")
    assert "RECV_F1@s1<-0" in r1[:k] and r1[k + 1] == "SEND_B0@s1->0"


# ---- runtime -----------------------------------------------------------------------------------
def _config(tp=1, ep=1, pp=1, sp=False, world=1, gbs=GBS, recompute="none") -> Config:
    cfg = Config()
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optimizer
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 4, 16, 2, 32
    m.vocab_size, m.seq_length, m.make_vocab_size_divisible_by = VOCAB, SEQ, 8
    m.num_experts, m.moe_top_k, m.moe_aux_loss_coeff, m.moe_z_loss_coeff = 4, 2, 0.01, 0.001
    m.recompute = recompute
    p.tensor, p.expert, p.pipeline, p.sequence_parallel = tp, ep, pp, sp
    p.bucket_size_mb = 0.001
    t.micro_batch_size, t.global_batch_size, t.seed = 1, gbs, 1234
    o.name, o.lr, o.weight_decay, o.clip_grad, o.lr_decay_style = "sgd", LR, 0.0, 0.0, "constant"
    return validate_config(cfg, world)


def _train(cfg: Config, ctx, actions, timeline=None) -> dict:
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.step import run_global_batch

    torch.manual_seed(0)
    chunks, ddp, optimizer, _ = build_model_and_optimizer(cfg, ctx)
    gbs = cfg.train.global_batch_size
    rows, r = gbs // ctx.dp.size, ctx.dp.rank
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(50 + step)
        tokens, labels = (torch.randint(0, VOCAB, (gbs, SEQ), generator=g) for _ in range(2))
        mbs = [{"tokens": tokens[i:i + 1], "labels": labels[i:i + 1]} for i in range(r * rows, (r + 1) * rows)]
        optimizer.zero_grad()
        if timeline is not None:
            timeline.clear()  # keep the last step's
        out = run_global_batch(cfg, ctx, chunks, mbs, forward_only=False, loss_scale=optimizer.loss_scale,
                               ddp=ddp, actions=actions, timeline=timeline)
        optimizer.step()
        losses.append(out.loss)
    # Evaluation runs the same list forward-only (an FB keeps its forward half).
    losses.append(run_global_batch(cfg, ctx, chunks, mbs, forward_only=True, actions=actions).loss)
    params = {p.meta.logical_name: p.detach().clone() for c in chunks for p in c.parameters()}
    return {"losses": losses, "params": params}


def _plain_and_overlapped(schedule, kw, world, v=1):
    """Train 3 steps with the plain list, then (fresh model, same seed) with the overlapped one
    that ``parallel.overlap_moe_expert_parallel_comm`` makes the training step build."""
    from paratron.training.step import rank_actions

    cfg = _config(world=world, **kw)
    cfg.parallel.schedule, cfg.parallel.virtual_pipeline = schedule, v
    validate_config(cfg, world)
    p = cfg.parallel
    ctx = (ParallelContext.build(tp=p.tensor, ep=p.expert, pp=p.pipeline) if world > 1
           else ParallelContext.single())
    m = cfg.train.global_batch_size // ctx.dp.size
    plain = rank_actions(cfg, ctx, m)
    p.overlap_moe_expert_parallel_comm = True
    paired = rank_actions(cfg, ctx, m)
    assert not any(a.kind == "FB" for a in plain)
    timeline = []
    return {"plain": _train(cfg, ctx, plain), "overlap": _train(cfg, ctx, paired, timeline),
            "timeline": timeline, "pp_rank": ctx.pp.rank, "pairs": sum(a.kind == "FB" for a in paired)}


def _assert_same(res, what):
    for a, b in zip(res["plain"]["losses"], res["overlap"]["losses"]):
        assert a == pytest.approx(b, rel=TOL, abs=TOL), f"{what}: loss {a} vs {b}"
    for n, want in res["plain"]["params"].items():
        torch.testing.assert_close(res["overlap"]["params"][n], want, rtol=TOL, atol=TOL,
                                   msg=lambda msg: f"{what} param {n}: {msg}")


@pytest.mark.parametrize("schedule,kw", [("1f1b", {}), ("zb-h1", {}), ("1f1b", dict(recompute="full"))])
def test_one_process_overlap_matches_plain(schedule, kw):
    """Split backward (zb-h1: W's after the pairs), and full recompute (a backward segment re-runs
    a layer's forward, whose MoE layer must not call the pair's hook again)."""
    res = _plain_and_overlapped(schedule, kw, 1)
    assert res["pairs"] == 3
    _assert_same(res, f"{schedule} {kw}")


LAYOUTS = {"ep2": (2, dict(ep=2)), "ep2-tp2": (4, dict(ep=2, tp=2)), "ep2-tp2-sp": (4, dict(ep=2, tp=2, sp=True)),
           "ep2-pp2": (4, dict(ep=2, pp=2, gbs=8))}  # 4 microbatches per pipeline: room for pairs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_overlap_matches_plain_schedule(name):
    world, kw = LAYOUTS[name]
    results = run_ranks(_plain_and_overlapped, world, "1f1b", kw, world, timeout=300)
    for res in results:
        assert res["pairs"] > 0
        _assert_same(res, name)
    if name == "ep2-pp2":
        for res in results:
            _assert_dispatch_inside_other_backward(res["timeline"], res["pp_rank"])


@pytest.mark.parametrize("schedule", ["interleaved", pytest.param("zbv", marks=pytest.mark.slow)])
def test_overlap_matches_plain_with_two_chunks_per_rank(schedule):
    """EP=2 x PP=2 with 2 model chunks per rank (1 layer each): interleaved pairs a forward of one
    chunk with a backward of the other; zbv pairs a forward with a split backward (B, then W)."""
    results = run_ranks(_plain_and_overlapped, 4, schedule, dict(ep=2, pp=2, gbs=8), 4, 2, timeout=300)
    assert all(res["pairs"] > 0 for res in results if res["pp_rank"] == 0)
    for res in results:
        _assert_same(res, schedule)


@pytest.mark.slow
def test_overlap_matches_plain_schedule_ep2_tp2_pp2():
    """All three at once: 8 ranks (slow on 2 cores)."""
    results = run_ranks(_plain_and_overlapped, 8, "1f1b", dict(ep=2, tp=2, sp=True, pp=2, gbs=8), 8, timeout=600)
    for res in results:
        _assert_same(res, "ep2-tp2-sp-pp2")
        _assert_dispatch_inside_other_backward(res["timeline"], res["pp_rank"])


def _assert_dispatch_inside_other_backward(events, rank):
    """Some dispatch all-to-all of microbatch a runs from launch to wait inside the backward of
    another microbatch b on this rank (the backward's pieces ran while it was in flight)."""
    a2a = [e for e in events if e.kind == "dispatch" and e.lane == "comm"]
    backward = [e for e in events if e.kind in ("B", "BW") and e.lane == ""]
    assert a2a, f"rank {rank}: no all-to-all recorded"
    inside = [(x, y) for x in a2a for y in backward
              if y.microbatch != x.microbatch and y.start <= x.start and x.end <= y.end]
    assert inside, f"rank {rank}: no dispatch inside another microbatch's backward: {a2a} / {backward}"
