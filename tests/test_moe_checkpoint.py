"""MoE checkpoints reshard across expert layouts: expert params carry global expert ids in their
logical names and their expert-TP slice in their shard spec, so a model saved at EP=2 x
expert-TP=2 (x TP=2) loads bitwise into EP=1, EP=4 and EP=2 x TP=2 layouts."""

import zlib

import torch

from paratron.checkpoint.io import load_model_full
from paratron.checkpoint.manager import CheckpointManager
from paratron.config import CheckpointConfig, Config
from paratron.models.gpt import build_model_chunks, load_full_state
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks


def moe_config() -> Config:
    cfg = Config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length, m.vocab_size = 2, 16, 2, 8, 40
    m.ffn_hidden_size, m.num_experts, m.moe_top_k, m.moe_shared_expert_ffn_hidden_size = 32, 4, 2, 16
    return cfg


def targets(cfg: Config) -> dict[str, torch.Tensor]:
    """A full tensor per logical name, unlike the model's own init (so a load is visible)."""
    out = {}
    for c in build_model_chunks(cfg.model, ParallelContext.single(), seed=7):
        for p in c.parameters():
            g = torch.Generator().manual_seed(zlib.crc32(p.meta.logical_name.encode()))
            out[p.meta.logical_name] = torch.randn(p.meta.shard.global_shape, generator=g)
    return out


LOAD_LAYOUTS = [dict(tp=1, ep=1, etp=1), dict(tp=1, ep=4, etp=1), dict(tp=2, ep=2, etp=1), dict(tp=1, ep=2, etp=2)]


def _save_then_load(root):
    cfg = moe_config()
    full = targets(cfg)
    ctx = ParallelContext.build(tp=2, ep=2, expert_tp=2)
    chunks = build_model_chunks(cfg.model, ctx, seed=1)
    load_full_state(chunks, full)
    cfg.checkpoint.save = root
    CheckpointManager(cfg.checkpoint, ctx, cfg).save(1, chunks, None, None, {})
    checked = {}
    for lay in LOAD_LAYOUTS:
        ctx_b = ParallelContext.build(tp=lay["tp"], ep=lay["ep"], expert_tp=lay["etp"])
        chunks_b = build_model_chunks(cfg.model, ctx_b, seed=2)
        CheckpointManager(CheckpointConfig(load=root, load_optimizer=False), ctx_b, cfg).load(chunks_b, None, None)
        names = []
        for c in chunks_b:
            for p in c.parameters():
                assert torch.equal(p.meta.shard.valid(p.detach()), full[p.meta.logical_name][p.meta.shard.slices()]), \
                    f"{lay}: {p.meta.logical_name}"
                names.append(p.meta.logical_name)
        checked[str(lay)] = sorted(n for n in names if ".experts." in n)
    return checked


def test_moe_params_reshard_across_expert_layouts(tmp_path):
    root = str(tmp_path / "ck")
    results = run_ranks(_save_then_load, 4, root, timeout=300)
    cfg = moe_config()
    full = targets(cfg)
    for lay in LOAD_LAYOUTS:
        held = set().union(*(set(r[str(lay)]) for r in results))
        assert held == {n for n in full if ".experts." in n}, lay  # every expert lives somewhere
    _, tensors = load_model_full(root)
    assert set(tensors) == set(full)
    for n, t in full.items():
        assert torch.equal(tensors[n], t), n
