"""Per-shard initialisation: each rank draws only the tiles of its own shard,
and every layout starts from bitwise the same full tensors, within one tile of extra memory."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers import gpt2_config
from paratron.config import ModelConfig
from paratron.layers.init import TILE, full_init, init_shard_, normal_
from paratron.models.gpt import build_model_chunks
from paratron.parallel.comm import Group
from paratron.parallel.context import ParallelContext
from paratron.parallel.params import ShardSpec, unique_params


def rank_view(tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0) -> ParallelContext:
    """A context that sees one rank of a TP x PP layout, without process groups: initialisation
    reads only the sizes and ranks, never communicates, so one process can build every rank."""
    ctx = ParallelContext.single()
    led = ctx.ledger
    return dataclasses.replace(ctx, tp=Group("tp", list(range(tp)), tp_rank, None, led),
                               expert_tp=Group("expert_tp", list(range(tp)), tp_rank, None, led),
                               pp=Group("pp", list(range(pp)), pp_rank, None, led))


def full_tensors(cfg: ModelConfig, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor, assembled from the shards of all TP x PP ranks."""
    out: dict[str, torch.Tensor] = {}
    for s in range(pp):
        for r in range(tp):
            for p in unique_params(build_model_chunks(cfg, rank_view(tp, r, pp, s), seed=5)):
                spec = p.meta.shard
                full = out.setdefault(p.meta.logical_name, torch.full(spec.global_shape, float("nan")))
                seen = full[spec.slices()]
                mine = spec.valid(p.detach())
                # a copy held twice (a tied embedding on both end stages) must agree
                assert torch.equal(seen[~seen.isnan()], mine[~seen.isnan()]), p.meta.logical_name
                full[spec.slices()] = mine
    return out


def swiglu_moe_config() -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, vocab_size=300,
                       seq_length=16, ffn_hidden_size=320, activation="swiglu", add_bias_linear=True,
                       tie_embeddings=True, num_experts=4, moe_layer_freq=2)


@pytest.mark.parametrize("make_cfg", [swiglu_moe_config, lambda: gpt2_config(
    num_layers=2, hidden_size=48, num_attention_heads=4, vocab_size=700, seq_length=8, tie_embeddings=False)],
    ids=["swiglu_gqa_moe_tied", "gpt2_untied"])
def test_every_layout_draws_the_same_full_tensors(make_cfg):
    cfg = make_cfg()
    ref = full_tensors(cfg, 1, 1)
    assert any(t.shape[0] > TILE[0] or (t.dim() > 1 and t.shape[1] > TILE[1]) for t in ref.values())
    for tp in (1, 2, 4):
        for pp in (1, 2):
            got = full_tensors(cfg, tp, pp)
            assert got.keys() == ref.keys()
            for name, t in ref.items():
                assert not got[name].isnan().any(), f"{name} not covered at tp={tp} pp={pp}"
                assert torch.equal(got[name], t), f"{name} differs at tp={tp} pp={pp}"


def test_shard_equals_slice_of_full_draw():
    """Every kind of slice (rows, columns, a strided fused weight, a vector, a 3-D tensor) is the
    same slice of the tiled full tensor; the fused blocks are the separately named tensors."""
    shape = (2 * TILE[0] + 37, TILE[1] + 11)
    full = full_init(shape, 3, "w", 0.5)
    for offsets, local in [((0, 0), shape), ((100, 0), (300, shape[1])), ((0, 70), (shape[0], 190)),
                           ((255, 255), (3, 3))]:
        out = init_shard_(torch.empty(local), normal_(0.5), ShardSpec(shape, offsets, local), 3, "w")
        assert torch.equal(out, full[ShardSpec(shape, offsets, local).slices()])
    gate, up = full_init((300, 40), 3, "g", 0.02), full_init((300, 40), 3, "u", 0.02)
    spec = ShardSpec((600, 40), (150, 0), (300, 40), stride=2)
    out = init_shard_(torch.empty(300, 40), normal_(0.02), spec, 3, "fused", ("g", "u"))
    assert torch.equal(out, torch.cat([gate, up])[spec.slices()])
    vec = full_init((1000,), 3, "b", 1.0)
    assert torch.equal(init_shard_(torch.empty(250), normal_(1.0), ShardSpec((1000,), (500,), (250,)), 3, "b"),
                       vec[500:750])
    cube = full_init((4, 300, 5), 3, "c", 1.0)
    spec = ShardSpec((4, 300, 5), (1, 100, 0), (2, 150, 5))
    assert torch.equal(init_shard_(torch.empty(2, 150, 5), normal_(1.0), spec, 3, "c"), cube[spec.slices()])
    assert not torch.equal(full_init(shape, 3, "w2", 0.5), full), "the name must seed the draw"
    assert full.std().item() == pytest.approx(0.5, rel=0.02)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages created under it that are still alive (each op's
    new output storages are added; a storage is subtracted once its last reference is gone), and
    the peak of that count. Storages created before the mode are not counted."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = self.peak = 0

    def _collect(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._collect()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
        return out


def test_peak_init_memory_is_the_own_shard_plus_a_tile():
    """A 32k x 1024 embedding at TP=4: the old init drew the 128 MiB full table on every rank."""
    cfg = ModelConfig(num_layers=1, hidden_size=1024, num_attention_heads=8, vocab_size=32000, seq_length=16,
                      tie_embeddings=False)
    for rank in (0, 3):
        with LiveBytes() as counter:
            chunks = build_model_chunks(cfg, rank_view(4, rank), seed=1)
        own = sum(p.numel() * p.element_size() for p in unique_params(chunks))
        assert own > 50e6
        assert counter.peak <= 1.2 * own, (counter.peak, own)
        assert counter.peak >= own  # the counter sees the parameters themselves
    with LiveBytes() as counter:  # the counter sees a dropped temporary as freed
        x = torch.empty(1 << 20)
        del x
        y = torch.empty(1 << 20)
    assert counter.peak == counter.now == y.numel() * 4
