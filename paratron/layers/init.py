"""Layout-independent initialisation (docs/DESIGN.md principle 1).

Each parameter's *full* logical tensor is drawn from a ``torch.Generator`` seeded by a stable
hash of ``(seed, logical_name)``; every rank then keeps its own slice. So TP=4 starts from
exactly the TP=1 weights, and a parameter's values do not depend on the order in which the model
creates its parameters.

Init methods passed to layers (``init_method=``) are either

* a :class:`NormalInit` (from :func:`normal_` or :func:`scaled_normal_`), which the layer calls
  with its ``seed`` and ``logical_name``; or
* any callable ``init_method(full_shape) -> Tensor`` returning the full fp32 tensor (the caller
  then owns the seeding).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Union

import torch

__all__ = ["seed_for", "generator_for", "full_init", "NormalInit", "normal_", "scaled_normal_",
           "draw_full", "InitMethod"]


def seed_for(seed: int, logical_name: str) -> int:
    """A 63-bit seed from ``(seed, logical_name)``, stable across processes and Python runs
    (``hashlib``, not Python's salted ``hash``)."""
    digest = hashlib.sha256(f"{int(seed)}/{logical_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator_for(seed: int, logical_name: str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded by :func:`seed_for`."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed_for(seed, logical_name))
    return g


def full_init(shape, seed: int, logical_name: str, std: float) -> torch.Tensor:
    """The full fp32 tensor of one parameter, ~ N(0, std^2), drawn on the CPU.

    Args:
        shape: the full logical shape (e.g. ``(out, in)`` of a linear weight, vocab unpadded).
        seed: the run's seed (``train.seed``).
        logical_name: the layout-independent parameter name, e.g. ``layers.0.mlp.fc1.weight``.
        std: standard deviation.
    Raises:
        ValueError: ``std`` is negative.
    """
    if std < 0:
        raise ValueError(f"init std must be >= 0, got {std} for {logical_name}")
    out = torch.empty(tuple(int(s) for s in shape), dtype=torch.float32)
    if out.numel():
        out.normal_(0.0, std, generator=generator_for(seed, logical_name))
    return out


@dataclass(frozen=True)
class NormalInit:
    """N(0, std^2) drawn whole from the (seed, logical_name) generator."""

    std: float

    def __call__(self, shape, *, seed: int, logical_name: str) -> torch.Tensor:
        return full_init(shape, seed, logical_name, self.std)


def normal_(std: float = 0.02) -> NormalInit:
    """Megatron's default init: N(0, std^2) (Shoeybi et al. 2019, section 4: std 0.02)."""
    return NormalInit(float(std))


def scaled_normal_(std: float, num_layers: int) -> NormalInit:
    """GPT-2's init of output projections: N(0, (std / sqrt(2 * num_layers))^2) (Radford et al.
    2019, section 2.3), used by Megatron for the attention and MLP output linears.

    Raises:
        ValueError: ``num_layers < 1``.
    """
    if num_layers < 1:
        raise ValueError(f"model.num_layers must be >= 1 for the scaled init, got {num_layers}")
    return NormalInit(float(std) / math.sqrt(2.0 * num_layers))


InitMethod = Union[NormalInit, Callable[..., torch.Tensor]]


def draw_full(init_method: InitMethod | None, shape, seed: int, logical_name: str) -> torch.Tensor:
    """The full fp32 tensor for ``shape`` from ``init_method`` (default ``normal_(0.02)``).

    Raises:
        ValueError: the init method returned a tensor of another shape.
    """
    shape = tuple(int(s) for s in shape)
    method = init_method if init_method is not None else normal_()
    if isinstance(method, NormalInit):
        full = method(shape, seed=seed, logical_name=logical_name)
    else:
        full = method(shape)
    if tuple(full.shape) != shape:
        raise ValueError(f"init_method for {logical_name} returned shape {tuple(full.shape)}, "
                         f"expected the full shape {shape}")
    return full.to(torch.float32)
