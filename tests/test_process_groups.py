"""A training run creates exactly the process groups it uses.

Each rank counts the real ``torch.distributed.new_group`` calls (patched in the forked rank) and,
through the communication ledger, the groups whose collectives reached ``torch.distributed`` over
a few real training steps. The process groups a rank joined must be exactly the rank sets of the
groups it used, and no rank may call ``new_group`` for a rank set that no rank used.
"""

from __future__ import annotations

import pytest
import torch

from paratron.local_ranks import RankFailure, run_ranks

TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
    "model.seq_length=16", "model.make_vocab_size_divisible_by=16",
    "train.micro_batch_size=1", "train.global_batch_size=4", "train.train_iters=2",
    "train.eval_interval=100", "train.eval_iters=0", "train.seed=3",
    "logging.log_interval=1", "logging.tensorboard=false", "logging.progress=false",
]


def _train_counting(overrides: list[str], run_dir: str) -> dict:
    """One rank of a run: its ``new_group`` calls, and the group kinds and rank sets it used."""
    import torch.distributed as dist

    from paratron.rules import load_config
    import paratron.launch.runner as runner
    from paratron.parallel.context import GROUP_KINDS

    calls = []
    real_new_group, real_build = dist.new_group, runner.build_context

    def counting_new_group(ranks=None, *args, **kwargs):
        pg = real_new_group(ranks, *args, **kwargs)
        calls.append((tuple(ranks), pg not in (None, dist.GroupMember.NON_GROUP_MEMBER)))
        return pg

    seen = {}

    def build_and_count(cfg):
        ctx = seen["ctx"] = real_build(cfg)
        ctx.ledger.enabled = True  # from here on every collective of a group of >1 rank is counted
        return ctx

    dist.new_group, runner.build_context = counting_new_group, build_and_count  # this forked rank only
    code = runner.run_training(load_config(None, overrides), run_dir)
    ctx, world = seen["ctx"], seen["ctx"].world_size
    used = sorted({g for _, g in ctx.ledger.entries if g in GROUP_KINDS})
    # The checkpoint manager's own gloo group spans every rank: not one of the layout's groups.
    layout_calls = [(r, member) for r, member in calls if len(r) < world]
    return {"code": code, "used": used,
            "used_sets": sorted({tuple(ctx.group(k).ranks) for k in used if 1 < ctx.group(k).size < world}),
            "joined": sorted(r for r, member in layout_calls if member),
            "called": sorted({r for r, _ in layout_calls}), "calls": len(layout_calls)}


def _check_exact(out: list[dict]) -> None:
    assert [o["code"] for o in out] == [0] * len(out)
    for rank, o in enumerate(out):
        assert o["joined"] == o["used_sets"], (rank, o)
    everything_used = sorted({s for o in out for s in o["used_sets"]})
    assert all(o["called"] == everything_used for o in out), [o["called"] for o in out]


def test_tp2_pp2_dp2_creates_only_the_groups_it_uses(tiny_corpus, tmp_path):
    """Dense GPT, tied embeddings, 8 ranks. Used: tp, pp (embedding = pp at two stages),
    dp_cp (= dp): 3 process groups per rank (the eager code made 5: also mp and tp_dp_cp)."""
    layout = ["parallel.tensor=2", "parallel.pipeline=2", "model.tie_embeddings=true"]
    out = run_ranks(_train_counting, 8, TINY + tiny_corpus + layout, str(tmp_path / "run"), timeout=300)
    _check_exact(out)
    for o in out:
        assert set(o["used"]) == {"tp", "pp", "dp_cp", "embedding", "world"}, o["used"]
        assert len(o["joined"]) == 3
        assert o["calls"] == 12  # tp, dp, pp: 4 groups each, every rank takes part in creating each


LAYOUTS_4 = {
    # MoE, TP=2 with SP, EP=2, DP=2, the sequence-level aux loss: the expert kinds and dp are used.
    "moe": (["parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true",
             "model.num_experts=4", "model.moe_top_k=2", "model.moe_aux_loss_type=seq"],
            {"tp", "ep", "expert_dp", "dp", "dp_cp"}),
    # PP=4, tied embeddings: the embedding group {0, 3} is its own group, on two ranks only.
    "pp4_tied": (["parallel.pipeline=4", "model.num_layers=4", "model.tie_embeddings=true"],
                 {"embedding", "pp"}),
    # CP=2, DP=2: cp and dp_cp are used, dp (without cp) is not.
    "cp2_dp2": (["parallel.context=2"], {"cp", "dp_cp"}),
    # PP=2 with 2 virtual stages (interleaved), ZeRO-3 over DP=2.
    "vpp_zero3": (["parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.schedule=interleaved",
                   "model.num_layers=4", "parallel.zero=3", "train.global_batch_size=8"], {"pp", "dp_cp"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS_4))
def test_other_layouts_create_only_the_groups_they_use(tiny_corpus, tmp_path, name):
    """The same count at 4 ranks for the other paths that choose groups: experts, an embedding
    group apart from the pipeline group, context parallelism, virtual stages with ZeRO-3."""
    extra, must_use = LAYOUTS_4[name]
    out = run_ranks(_train_counting, 4, TINY + tiny_corpus + extra, str(tmp_path / "run"), timeout=300)
    _check_exact(out)
    assert must_use <= set().union(*(o["used"] for o in out)), [o["used"] for o in out]


def _collective_on_a_kind_left_out():
    from paratron.parallel.comm import GroupNotCreated
    from paratron.parallel.context import ParallelContext

    ctx = ParallelContext.build(tp=2, kinds=("pp",))
    t = torch.ones(1)
    ctx.pp.all_reduce(t)  # size 1: no process group needed, created or not
    try:
        ctx.tp.all_reduce(t)
    except GroupNotCreated as e:
        return ctx.created_groups, str(e)
    return ctx.created_groups, None


def test_a_group_left_out_raises_instead_of_using_the_default_group():
    out = run_ranks(_collective_on_a_kind_left_out, 2, timeout=60)
    for created, message in out:
        assert created == ()
        assert message is not None and "'tp'" in message and "groups_used" in message


def _unknown_kind():
    from paratron.parallel.context import ParallelContext

    ParallelContext.build(kinds=("tp", "tensor"))


def test_an_unknown_kind_is_refused():
    with pytest.raises(RankFailure, match="'tensor'"):
        run_ranks(_unknown_kind, 1, timeout=60)


def test_info_world_size_writes_output_and_refuses_non_positive(tmp_path, capsys):
    """``paratron info --world-size N --output F`` writes F (it only printed), and N <= 0 is refused
    naming the flag (0 used to fall through to a one-rank run, -3 to a batch-size error)."""
    import json

    from paratron.cli import main

    out = tmp_path / "world.json"
    assert main(["info", "--world-size", "4", "--set", "parallel.tensor=2", "--output", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["world"] == 4 and written["groups"]["tp"] == [[0, 1], [2, 3]]
    printed = capsys.readouterr().out
    assert written == json.loads(printed)
    # one line per group kind, not one per rank
    assert '  "tp": [[0, 1], [2, 3]],' in printed.splitlines()
    assert len(printed.splitlines()) == len(written) + len(written["groups"]) + 3
    for bad in ("0", "-3"):
        assert main(["info", "--world-size", bad]) == 2
        assert f"--world-size={bad} must be a positive integer" in capsys.readouterr().err
