"""Training-state resharding: a tp2·pp2·dp2 ZeRO-1 run's weights and Adam state load bitwise under
other layouts (one process, tp4·dp2, pp4·dp2, dp8 without ZeRO, interleaved tp1·pp2) and training
continues with the original layout's losses; MoE state from EP=1 to EP=2/4; missing optimizer
state fails loudly; a weights-only load refreshes the fp32 main weights."""

import zlib

import pytest
import torch

from paratron.checkpoint.io import load_tensors_full, save_model_full
from paratron.checkpoint.items import CheckpointError
from paratron.checkpoint.manager import CheckpointManager
from paratron.config import CheckpointConfig
from paratron.models.gpt import build_model_chunks, load_full_state
from paratron.optim import DistributedDataParallel, build_lr_scheduler, build_optimizer
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks
from test_checkpoint_reshard import check_params, targets, tiny_config

KINDS = ("exp_avg", "exp_avg_sq")
STEP = 5


def state_targets(full: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Full 2-D tensors per optimizer kind; main weights are the model weights themselves."""
    out = {"main_param": {n: t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
                          for n, t in full.items()}}
    for kind in KINDS:
        out[kind] = {}
        for n, t in out["main_param"].items():
            g = torch.Generator().manual_seed(zlib.crc32(f"{kind}/{n}".encode()))
            out[kind][n] = torch.rand(t.shape, generator=g)
    return out


def build(cfg, ctx, *, zero: bool, seed: int, virtual: int = 1, precision: str = "fp32"):
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    chunks = build_model_chunks(cfg.model, ctx, seed=seed, virtual_pipeline=virtual, params_dtype=dtype)
    # Small buckets: ZeRO shard boundaries fall inside parameters (the embedding included).
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, zero=int(zero))
    opt = build_optimizer(chunks, ctx, cfg.optimizer, ddp, precision=precision)
    sched = build_lr_scheduler(cfg.optimizer, 100, opt)
    return chunks, opt, sched


def fill_state(opt, st) -> None:
    for key, pieces in opt.sharded_state_dict().items():
        _, kind, name = key.split("/", 2)
        for view, spec in pieces:
            view.copy_(st[kind][name][spec.slices()])


def check_state(opt, st) -> int:
    n = 0
    for key, pieces in opt.sharded_state_dict().items():
        _, kind, name = key.split("/", 2)
        for view, spec in pieces:
            assert torch.equal(view, st[kind][name][spec.slices()]), (key, spec)
            n += 1
    return n


LAYOUTS = {
    "tp4-dp2-zero": dict(tp=4, pp=1, v=1, zero=1),
    "pp4-dp2-zero": dict(tp=1, pp=4, v=1, zero=1),
    "dp8": dict(tp=1, pp=1, v=1, zero=0, mbs=1),
    "tp1-pp2-interleaved-zero": dict(tp=1, pp=2, v=2, zero=1, mbs=1),  # 2 microbatches per DP rank
    "dp8-zero3": dict(tp=1, pp=1, v=1, zero=3, mbs=1),
}
ORIGINAL = dict(tp=2, pp=2, v=1, zero=1)
GBS, MBS, SAVE_AT, AFTER = 8, 2, 2, 2  # global batch, microbatch, save after step 2, then 2 more


def train_config(lay: dict):
    """The tiny model with one large embedding (vocab 500 of a 32-wide model, padded to 512): with
    one gradient bucket, ZeRO-1's slice boundaries fall inside it."""
    cfg = tiny_config()
    cfg.model.vocab_size = 500
    p = cfg.parallel
    p.tensor, p.pipeline, p.virtual_pipeline, p.zero = lay["tp"], lay["pp"], lay["v"], lay["zero"]
    p.schedule = "interleaved" if lay["v"] > 1 else "1f1b"
    cfg.train.micro_batch_size, cfg.train.global_batch_size = lay.get("mbs", MBS), GBS
    cfg.train.train_iters = 100
    cfg.optimizer.lr, cfg.optimizer.lr_warmup_iters = 3e-3, 1
    return cfg


def microbatches(step: int, ctx, mbs: int) -> list[dict]:
    """This DP rank's share of global batch ``step``, in microbatches of ``mbs`` samples."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 500, (GBS, 16), generator=g)
    labels = torch.randint(0, 500, (GBS, 16), generator=g)
    per = GBS // ctx.dp.size
    assert per % mbs == 0, (per, mbs)
    lo = ctx.dp.rank * per
    return [{"tokens": tokens[i:i + mbs], "labels": labels[i:i + mbs]} for i in range(lo, lo + per, mbs)]


def train_steps(cfg, ctx, model, steps) -> list[float]:
    from paratron.training.step import run_global_batch

    chunks, _, opt, sched = model
    losses = []
    for step in steps:
        opt.zero_grad()
        out = run_global_batch(cfg, ctx, chunks, microbatches(step, ctx, cfg.train.micro_batch_size),
                               forward_only=False, loss_scale=opt.loss_scale, ddp=opt.ddp)
        opt.step()
        sched.step()
        losses.append(out.loss)
    return losses


def check_against_checkpoint(saved, model) -> int:
    """The params and every optimizer chunk equal the checkpoint's full tensors bitwise.

    ``saved``: ``(model tensors, optimizer tensors)`` read in full from the checkpoint."""
    chunks, ddp, opt, _ = model
    with ddp.full_params():  # ZeRO-3 keeps only shards between uses
        check_params(chunks, saved[0])
    full = saved[1]
    n = 0
    for key, pieces in opt.sharded_state_dict().items():
        for view, spec in pieces:
            assert torch.equal(view, full[key[len("optimizer/"):]][spec.slices()]), (key, spec)
            n += 1
    return n


def _train_save_and_resume_elsewhere(root):
    from paratron.training.builders import build_model_and_optimizer

    cfg = train_config(ORIGINAL)
    ctx = ParallelContext.build(tp=2, pp=2)
    model = build_model_and_optimizer(cfg, ctx)
    train_steps(cfg, ctx, model, range(1, SAVE_AT + 1))
    cfg.checkpoint.save = root
    chunks, _, opt, sched = model
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(SAVE_AT, chunks, opt, sched, {"iteration": SAVE_AT})
    steps_after = range(SAVE_AT + 1, SAVE_AT + AFTER + 1)
    reference = train_steps(cfg, ctx, model, steps_after)  # the uninterrupted original layout
    out = {"reference": reference}
    saved = load_tensors_full(root, "model/"), load_tensors_full(root, "optimizer/")
    layouts = dict(LAYOUTS)
    if ctx.rank == 0:
        layouts["single"] = None
    for name, lay in layouts.items():
        out[name] = load_and_continue(root, lay, saved, SAVE_AT, steps_after)
    return out


def load_and_continue(root, lay: dict | None, saved, save_at: int, steps_after) -> tuple[int, list[float]]:
    """Build layout ``lay`` (None: one process, no ZeRO), load the checkpoint at ``root`` (saved
    at step ``save_at``), check it against ``saved`` bitwise and train ``steps_after``.

    Returns: (number of optimizer chunks checked, the losses)."""
    from paratron.training.builders import build_model_and_optimizer

    if lay is None:
        cfg_b, ctx_b = train_config(dict(tp=1, pp=1, v=1, zero=0)), ParallelContext.single()
    else:
        cfg_b, ctx_b = train_config(lay), ParallelContext.build(tp=lay["tp"], pp=lay["pp"])
    model_b = build_model_and_optimizer(cfg_b, ctx_b)
    chunks_b, _, opt_b, sched_b = model_b
    extra = CheckpointManager(CheckpointConfig(load=root), ctx_b, cfg_b).load(chunks_b, opt_b, sched_b)
    assert extra == {"iteration": save_at}
    assert opt_b.step_count == save_at and sched_b.num_steps == save_at
    checked = check_against_checkpoint(saved, model_b)
    return checked, train_steps(cfg_b, ctx_b, model_b, steps_after)


def test_training_state_reshards_and_continues(tmp_path):
    """Save at tp2·pp2·dp2 with ZeRO-1 after 2 steps; load at one process, tp4·dp2, pp4·dp2, dp8
    (ZeRO off and ZeRO-3) and tp1·pp2 interleaved: weights and Adam state bitwise equal to the checkpoint's,
    and the next two steps' losses equal the uninterrupted original-layout run's to 1e-5."""
    root = str(tmp_path / "ck")
    results = run_ranks(_train_save_and_resume_elsewhere, 8, root, timeout=600)
    reference = results[0]["reference"]
    for name in list(LAYOUTS) + ["single"]:
        for rank, r in enumerate(results):
            if name not in r:
                continue
            checked, losses = r[name]
            assert checked > 0, (name, rank)
            for got, want in zip(losses, reference):
                assert abs(got - want) <= 1e-5 * abs(want), (name, rank, losses, reference)
    # The checkpoint itself holds full Adam moments of every parameter, split nowhere.
    moments = load_tensors_full(root, "optimizer/exp_avg_sq/")
    assert sorted(moments) == sorted(targets(train_config(ORIGINAL)))
    assert all(bool((t > 0).any()) for t in moments.values())


def test_missing_optimizer_state_fails_loudly(tmp_path):
    cfg = tiny_config()
    save_model_full(tmp_path / "ck", cfg, targets(cfg))
    ctx = ParallelContext.single()
    chunks, opt, sched = build(cfg, ctx, zero=False, seed=2)
    mgr = CheckpointManager(CheckpointConfig(load=str(tmp_path / "ck")), ctx, cfg)
    with pytest.raises(CheckpointError, match="holds no optimizer state.*load_optimizer=false"):
        mgr.load(chunks, opt, sched)


def test_weights_only_load_refreshes_bf16_main_weights(tmp_path):
    """load_optimizer=false: the fp32 main weights must follow the loaded params, else the first
    step would write the old init back."""
    cfg = tiny_config()
    full = targets(cfg)
    save_model_full(tmp_path / "ck", cfg, {k: v.bfloat16() for k, v in full.items()})
    ctx = ParallelContext.single()
    chunks, opt, sched = build(cfg, ctx, zero=False, seed=2, precision="bf16")
    mgr = CheckpointManager(CheckpointConfig(load=str(tmp_path / "ck"), load_optimizer=False), ctx, cfg)
    assert mgr.load(chunks, opt, sched) == {}
    assert opt.step_count == 0
    for key, pieces in opt.sharded_state_dict().items():
        if key.startswith("optimizer/main_param/"):
            name = key.split("/", 2)[2]
            t = full[name].bfloat16().float()
            t2d = t.reshape(-1, t.shape[-1]) if t.dim() > 1 else t.reshape(1, -1)
            for view, spec in pieces:
                assert torch.equal(view, t2d[spec.slices()]), key


def moe_config():
    cfg = tiny_config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size = 2, 16, 2, 32
    m.num_experts, m.moe_top_k = 4, 2
    return cfg


def _moe_ep1_to_ep2(root):
    cfg = moe_config()
    full = targets(cfg)
    st = state_targets(full)
    ctx = ParallelContext.build(ep=1)
    chunks, opt, sched = build(cfg, ctx, zero=True, seed=1)
    load_full_state(chunks, full)
    fill_state(opt, st)
    cfg.checkpoint.save = root
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(1, chunks, opt, sched, {})
    counts = {}
    for ep, zero in ((2, True), (4, False)):
        ctx_b = ParallelContext.build(ep=ep)
        chunks_b, opt_b, sched_b = build(cfg, ctx_b, zero=zero, seed=2)
        assert any(p.meta.is_expert for c in chunks_b for p in c.parameters())
        CheckpointManager(CheckpointConfig(load=root), ctx_b, cfg).load(chunks_b, opt_b, sched_b)
        check_params(chunks_b, full)
        counts[ep] = check_state(opt_b, st)
    return counts


def test_moe_state_reshards_from_ep1_to_ep2_and_ep4(tmp_path):
    counts = run_ranks(_moe_ep1_to_ep2, 4, str(tmp_path / "ck"), timeout=600)
    assert all(c[2] > 0 and c[4] > 0 for c in counts)
