"""Composable layer specs and the fused SwiGLU ``fc1 = [gate; up]`` with a strided shard:
one all-gather of the MLP input under sequence parallelism, a plugin that swaps one submodule,
and checkpoints with the old separate ``gate``/``up`` names still loading."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from paratron.checkpoint.io import load_model_full, load_model_into, save_model_full
from paratron.checkpoint.legacy import adapt_items
from paratron.checkpoint.items import SavedChunk
from paratron.config import Config
from paratron.models.blocks import BLOCKS, register_block
from paratron.models.gpt import build_model_chunks, gather_full_state, load_full_state
from paratron.models.layer import transformer_block
from paratron.models.layer_spec import TransformerLayerSpec
from paratron.models.presets import preset
from paratron.parallel.context import ParallelContext
from paratron.local_ranks import run_ranks

VOCAB, SEQ = 64, 16


def _llama(**kw):
    return preset("llama-tiny", vocab_size=VOCAB, seq_length=SEQ, **kw)


def _sp_all_gathers():
    """All-gathers over TP of one forward+backward of a llama layer's MLP, and of the whole
    layer, at TP=2 with sequence parallelism."""
    ctx = ParallelContext.build(tp=2)
    (chunk,) = build_model_chunks(_llama(num_layers=1), ctx, seed=3, sequence_parallel=True)
    layer = chunk.layers["0"]
    x = torch.randn(SEQ // 2, 2, 64, generator=torch.Generator().manual_seed(ctx.rank), requires_grad=True)
    counts = {}
    for name, fn in (("mlp", lambda: layer.mlp(x)), ("layer", lambda: layer(x))):
        with ctx.ledger.recording():
            fn().sum().backward()
            counts[name] = ctx.ledger.total("all_gather", "tp").calls
    return counts


def test_fused_gate_up_needs_one_all_gather_under_sp():
    """The MLP all-gathers its sequence-sharded input once for gate and up together (two separate
    column-parallel linears gathered it twice), and its backward gathers only fc2's output grad.
    A layer: QKV's and fc1's input in the forward, the proj and fc2 output grads in the backward."""
    for counts in run_ranks(_sp_all_gathers, 2, timeout=120):
        assert counts == {"mlp": 2, "layer": 4}, counts


def test_fused_fc1_is_gate_then_up():
    """The fused weight is ``[gate; up]``, drawn as the separate weights were, and computes
    ``silu(x gate^T) * (x up^T)``."""
    from paratron.layers.init import full_init

    cfg = _llama(num_layers=1)
    (chunk,) = build_model_chunks(cfg, ParallelContext.single(), seed=3)
    mlp = chunk.layers["0"].mlp
    f = mlp.fc2.in_features
    gate = full_init((f, 64), 3, "layers.0.mlp.gate.weight", cfg.init_method_std)
    up = full_init((f, 64), 3, "layers.0.mlp.up.weight", cfg.init_method_std)
    assert torch.equal(mlp.fc1.weight.detach(), torch.cat([gate, up]))
    x = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(0))
    want = mlp.fc2(torch.nn.functional.silu(x @ gate.t()) * (x @ up.t()))
    torch.testing.assert_close(mlp(x), want, rtol=1e-6, atol=1e-6)


class _NoAttention(nn.Module):
    """An attention replacement without parameters that adds nothing to the residual stream."""

    def forward(self, x, rope=None, layout=None):
        return torch.zeros_like(x)


def _no_attention(inputs, name):
    return _NoAttention()


def test_plugin_swaps_only_the_attention_through_a_spec():
    spec = dataclasses.replace(TransformerLayerSpec(), attention=_no_attention)
    register_block("test-no-attention", transformer_block(spec))
    try:
        cfg = _llama(num_layers=2)
        (base,) = build_model_chunks(cfg, ParallelContext.single(), seed=2)
        (swapped,) = build_model_chunks(dataclasses.replace(cfg, block="test-no-attention"),
                                        ParallelContext.single(), seed=2)
    finally:
        BLOCKS.unregister("test-no-attention")
    base_params = {p.meta.logical_name: p for p in base.parameters()}
    swapped_params = {p.meta.logical_name: p for p in swapped.parameters()}
    # Only the attention's parameters are gone; every other submodule is the default, same init.
    assert set(base_params) - set(swapped_params) == {n for n in base_params if ".attention." in n}
    assert all(torch.equal(p, base_params[n]) for n, p in swapped_params.items())
    for i in ("0", "1"):
        layer, ref = swapped.layers[i], base.layers[i]
        assert isinstance(layer.attention, _NoAttention)
        for name in ("input_norm", "post_attention_norm", "mlp"):
            assert type(getattr(layer, name)) is type(getattr(ref, name))
        x = torch.randn(SEQ, 2, 64, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(layer(x), x + ref.mlp(ref.post_attention_norm(x)), rtol=0, atol=0)


def _old_names(tensors):
    """The tensors as a checkpoint from before the fusion held them: separate gate and up."""
    out = {}
    for name, t in tensors.items():
        if name.endswith((".mlp.fc1.weight", ".mlp.fc1.bias")):
            gate, up = t.chunk(2)
            out[name.replace(".fc1.", ".gate.")], out[name.replace(".fc1.", ".up.")] = gate, up
        else:
            out[name] = t
    return out


def _load_old_at_tp2(root):
    cfg = Config()
    cfg.model = _llama(add_bias_linear=True)
    ctx = ParallelContext.build(tp=2)
    chunks = build_model_chunks(cfg.model, ctx, seed=9)
    load_model_into(root, chunks, config=cfg)
    return gather_full_state(chunks, ctx)


def test_checkpoint_with_separate_gate_and_up_still_loads(tmp_path):
    cfg = Config()
    cfg.model = _llama(add_bias_linear=True)
    (ref,) = build_model_chunks(cfg.model, ParallelContext.single(), seed=4)
    full = {n: t + 0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(len(n)))
            for n, t in gather_full_state([ref], ParallelContext.single()).items()}
    root = str(tmp_path / "old")
    save_model_full(root, cfg, _old_names(full))
    _, loaded = load_model_full(root)  # one process: the halves are fused on read
    assert loaded.keys() == full.keys() and all(torch.equal(loaded[n], t) for n, t in full.items())
    for got in run_ranks(_load_old_at_tp2, 2, root, timeout=120):  # sharded, strided: each block
        assert got.keys() == full.keys() and all(torch.equal(got[n], t) for n, t in full.items())
    (single,) = build_model_chunks(cfg.model, ParallelContext.single(), seed=5)
    load_full_state([single], loaded)


def test_optimizer_chunks_of_old_halves_map_block_by_block():
    """ZeRO-1 state chunks are rectangles of the 2-D view: a fused bias is ``[1, 2f]`` (blocks
    along the columns), a fused weight ``[2f, h]`` (blocks along the rows)."""
    bias, weight = torch.zeros(1, 3), torch.zeros(2, 4)
    items = {"optimizer/exp_avg/layers.1.mlp.fc1.bias": [SavedChunk(bias, (0, 5), (1, 8))],
             "optimizer/exp_avg/layers.1.mlp.fc1.weight": [SavedChunk(weight, (2, 0), (8, 4))],
             "model/layers.1.mlp.fc2.weight": []}
    saved = {f"optimizer/exp_avg/layers.1.mlp.{h}.{k}" for h in ("gate", "up") for k in ("weight", "bias")}
    out = adapt_items(items, saved | {"model/layers.1.mlp.fc2.weight"})
    (b,) = out["optimizer/exp_avg/layers.1.mlp.up.bias"]
    assert (b.offsets, b.global_shape) == ((0, 1), (1, 4)) and b.tensor is bias
    (w,) = out["optimizer/exp_avg/layers.1.mlp.gate.weight"]
    assert (w.offsets, w.global_shape) == ((2, 0), (4, 4)) and w.tensor is weight
    assert "model/layers.1.mlp.fc2.weight" in out
