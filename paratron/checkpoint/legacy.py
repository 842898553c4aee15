"""Checkpoints written before a rename still load: the logical names of older layouts.

SwiGLU's ``gate`` and ``up`` projections became one fused weight ``fc1 = [gate; up]`` (see
:mod:`paratron.models.mlp`). A checkpoint from before holds ``...mlp.gate.*`` and ``...mlp.up.*``
(dense MLP and shared expert; routed experts keep separate ``gate``/``up``). Loading asks for
``...mlp.fc1.*``; when the checkpoint lacks it but has both halves, each requested chunk, which
lies inside one block of the fused tensor, is read from the half it belongs to.
"""

from __future__ import annotations

import re

import torch

from .items import SavedChunk, StateItems

_FUSED = re.compile(r"^(?P<head>(?:model/|optimizer/[^/]+/)?layers\.\d+\.mlp(?:\.shared_expert)?)\.fc1\."
                    r"(?P<kind>weight|bias)$")
_HALF = re.compile(r"^(?P<head>layers\.\d+\.mlp(?:\.shared_expert)?)\.(?P<half>gate|up)\.(?P<kind>weight|bias)$")
HALVES = ("gate", "up")


def _fused_dim(shape: tuple[int, ...], kind: str) -> int:
    # A bias in the optimizer's 2-D view is [1, n]: its blocks run along the columns.
    return 1 if kind == "bias" and len(shape) == 2 and shape[0] == 1 else 0


def adapt_items(items: StateItems, saved_keys: set[str]) -> StateItems:
    """``items`` with every fused ``fc1`` key the checkpoint lacks, but whose ``gate``/``up`` halves
    it holds, replaced by chunks of those halves (views of the same storage)."""
    out: StateItems = {}
    for key, chunks in items.items():
        m = _FUSED.match(key)
        halves = [f"{m['head']}.{h}.{m['kind']}" for h in HALVES] if m else []
        if key in saved_keys or not halves or not all(h in saved_keys for h in halves):
            out[key] = chunks
            continue
        for c in chunks:
            d = _fused_dim(c.global_shape, m["kind"])
            block = c.global_shape[d] // len(HALVES)
            k = c.offsets[d] // block
            offsets = tuple(o - k * block if i == d else o for i, o in enumerate(c.offsets))
            shape = tuple(block if i == d else g for i, g in enumerate(c.global_shape))
            out.setdefault(halves[k], []).append(SavedChunk(c.tensor, offsets, shape))
    return out


def fuse_full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors keyed by logical name (or 2-D optimizer views) with old ``gate``/``up`` pairs
    concatenated into the fused ``fc1`` (other entries unchanged)."""
    out = dict(tensors)
    for name in tensors:
        m = _HALF.match(name)
        if m is None or m["half"] != "gate":
            continue
        up = f"{m['head']}.up.{m['kind']}"
        if up in tensors:
            gate = out.pop(name)
            d = _fused_dim(tuple(gate.shape), m["kind"])
            out[f"{m['head']}.fc1.{m['kind']}"] = torch.cat([gate, out.pop(up)], dim=d)
    return out
