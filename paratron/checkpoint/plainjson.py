"""Plain-JSON encoding of checkpoint metadata that may hold small tensors (RNG states, scaler state).

A tensor becomes ``{"__tensor__": {"dtype": "uint8", "shape": [...], "data": <base64>}}``;
decoding rebuilds it with ``torch.frombuffer`` and never runs code named by the file. Tuples
become lists; non-finite floats are written as ``Infinity``/``NaN``, which Python's json reads.
Anything else that JSON cannot hold is an error that names its path.
"""

from __future__ import annotations

import base64
from typing import Any

import torch

from .items import CheckpointError

_TAG = "__tensor__"


def encode(obj: Any, path: str = "") -> Any:
    """``obj`` with tensors replaced by tagged dicts; raises CheckpointError for other objects."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return {_TAG: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                       "data": base64.b64encode(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                       .decode("ascii")}}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise CheckpointError(f"checkpoint metadata {path or '<root>'} has a non-string key {k!r}")
            out[k] = encode(v, f"{path}.{k}" if path else k)
        return out
    if isinstance(obj, (list, tuple)):
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj  # json writes inf/nan as Infinity/NaN, which it reads back as floats
    raise CheckpointError(f"checkpoint metadata {path or '<root>'} is a {type(obj).__name__}; only numbers, "
                          "strings, lists, dicts and tensors can be saved")


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(obj, dict):
        if set(obj) == {_TAG}:
            spec = obj[_TAG]
            dtype = getattr(torch, spec["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"checkpoint metadata names an unknown dtype {spec['dtype']!r}")
            raw = bytearray(base64.b64decode(spec["data"]))
            flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            return flat.reshape(spec["shape"]).clone()
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj
