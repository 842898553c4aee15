"""ZeRO-3 checkpoints reshard: a run saved at TP=2 x DP=2 with ZeRO-3 (params, grads and optimizer
state sharded) loads at DP=4 with ZeRO-1, at TP=2 x PP=2 with ZeRO-1, at DP=4 with ZeRO-2 and
ZeRO-3, and at one process; weights and Adam state equal the checkpoint's bitwise, and the next
step's loss equals the uninterrupted run's to 1e-5. (The reverse, a ZeRO-1 TP=2 x PP=2 x DP=2
checkpoint loading at DP=8 ZeRO-3, is a layout of ``test_checkpoint_optim``.)"""

from paratron.checkpoint.io import load_tensors_full
from paratron.checkpoint.manager import CheckpointManager
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks
from test_checkpoint_optim import load_and_continue, train_config, train_steps

ORIGINAL = dict(tp=2, pp=1, v=1, zero=3, mbs=1)
TARGETS = {
    "dp4-zero1": dict(tp=1, pp=1, v=1, zero=1),
    "tp2-pp2-zero1": dict(tp=2, pp=2, v=1, zero=1),
    "dp4-zero2": dict(tp=1, pp=1, v=1, zero=2),
    "dp4-zero3": dict(tp=1, pp=1, v=1, zero=3),
}
SAVE_AT = 2


def _save_zero3_and_load_elsewhere(root):
    from paratron.training.builders import build_model_and_optimizer

    cfg = train_config(ORIGINAL)
    ctx = ParallelContext.build(tp=2)
    model = build_model_and_optimizer(cfg, ctx)
    train_steps(cfg, ctx, model, range(1, SAVE_AT + 1))
    cfg.checkpoint.save = root
    chunks, _, opt, sched = model
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(SAVE_AT, chunks, opt, sched, {"iteration": SAVE_AT})
    out = {"reference": train_steps(cfg, ctx, model, [SAVE_AT + 1])}
    saved = load_tensors_full(root, "model/"), load_tensors_full(root, "optimizer/")
    targets = dict(TARGETS)
    if ctx.rank == 0:
        targets["single"] = None
    for name, lay in targets.items():
        out[name] = load_and_continue(root, lay, saved, SAVE_AT, [SAVE_AT + 1])
    return out


def test_zero3_checkpoint_loads_at_other_layouts_and_levels(tmp_path):
    results = run_ranks(_save_zero3_and_load_elsewhere, 4, str(tmp_path / "ck"), timeout=600)
    reference = results[0]["reference"]
    assert any("single" in r for r in results)
    for r in results:
        assert r["reference"] == reference
        for name in list(TARGETS) + ["single"]:
            if name not in r:
                continue
            checked, losses = r[name]
            assert checked > 0, name
            assert abs(losses[0] - reference[0]) <= 1e-5 * abs(reference[0]), (name, losses, reference)
