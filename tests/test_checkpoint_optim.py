"""Optimizer-state resharding: fp32 main weights and Adam moments saved under tp2·pp2·dp2 with ZeRO-1
load bitwise under other layouts (one process, tp4·dp2, pp4·dp2, dp8 without ZeRO, interleaved
tp1·pp2); step count and scheduler come back; missing optimizer state fails loudly."""

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
from paratron.testing import run_ranks
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
    ddp = DistributedDataParallel(chunks, ctx, bucket_size_mb=0.002, use_distributed_optimizer=zero)
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
    "tp4-dp2-zero": dict(tp=4, pp=1, v=1, zero=True),
    "pp4-dp2-zero": dict(tp=1, pp=4, v=1, zero=True),
    "dp8": dict(tp=1, pp=1, v=1, zero=False),
    "tp1-pp2-interleaved-zero": dict(tp=1, pp=2, v=2, zero=True),
}


def _save_and_reshard(root):
    cfg = tiny_config()
    cfg.optimizer.lr_warmup_iters = 3
    full = targets(cfg)
    st = state_targets(full)
    ctx = ParallelContext.build(tp=2, pp=2)
    chunks, opt, sched = build(cfg, ctx, zero=True, seed=1)
    load_full_state(chunks, full)
    fill_state(opt, st)
    opt.step_count = STEP
    sched.step(STEP)
    cfg.checkpoint.save = root
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(STEP, chunks, opt, sched, {"iteration": STEP})
    lr_saved = opt.lr
    counts = {}
    for name, lay in LAYOUTS.items():
        ctx_b = ParallelContext.build(tp=lay["tp"], pp=lay["pp"])
        chunks_b, opt_b, sched_b = build(cfg, ctx_b, zero=lay["zero"], seed=2, virtual=lay["v"])
        extra = CheckpointManager(CheckpointConfig(load=root), ctx_b, cfg).load(chunks_b, opt_b, sched_b)
        assert extra == {"iteration": STEP}
        assert opt_b.step_count == STEP and sched_b.num_steps == STEP and opt_b.lr == lr_saved
        check_params(chunks_b, full)
        counts[name] = check_state(opt_b, st)
    if ctx.rank == 0:  # the one-process layout
        single = ParallelContext.single()
        chunks_s, opt_s, sched_s = build(cfg, single, zero=False, seed=3)
        CheckpointManager(CheckpointConfig(load=root), single, cfg).load(chunks_s, opt_s, sched_s)
        check_params(chunks_s, full)
        counts["single"] = check_state(opt_s, st)
        assert opt_s.step_count == STEP and sched_s.num_steps == STEP
    return counts


def test_optimizer_state_reshards_bitwise(tmp_path):
    root = str(tmp_path / "ck")
    counts = run_ranks(_save_and_reshard, 8, root, timeout=600)
    for name in LAYOUTS:
        assert all(c[name] > 0 for c in counts), name
    assert counts[0]["single"] > 0
    # The saved full moments are the targets, bitwise (gathered from the checkpoint alone).
    st = state_targets(targets(tiny_config()))
    for kind in KINDS + ("main_param",):
        saved = load_tensors_full(root, f"optimizer/{kind}/")
        assert sorted(saved) == sorted(st[kind])
        for n, t in st[kind].items():
            assert torch.equal(saved[n], t), (kind, n)


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
        assert any(getattr(p, "is_expert", False) for c in chunks_b for p in c.parameters())
        CheckpointManager(CheckpointConfig(load=root), ctx_b, cfg).load(chunks_b, opt_b, sched_b)
        check_params(chunks_b, full)
        counts[ep] = check_state(opt_b, st)
    return counts


def test_moe_state_reshards_from_ep1_to_ep2_and_ep4(tmp_path):
    counts = run_ranks(_moe_ep1_to_ep2, 4, str(tmp_path / "ck"), timeout=600)
    assert all(c[2] > 0 and c[4] > 0 for c in counts)
