"""Layout-independent initialisation, drawn per shard (docs/DESIGN.md principle 1).

A parameter's *full* logical tensor is defined tile by tile. The tensor is viewed as a matrix
(``[d0, d1*d2*...]``; a vector as one row) cut into fixed tiles of :data:`TILE` = ``(rows, cols)``
from the top-left corner; tile ``(i, j)`` is drawn whole from a generator seeded by a stable hash
of ``(seed, logical_name, i, j)``. A rank draws only the tiles that overlap its own
:class:`~paratron.parallel.params.ShardSpec` and copies the overlap into its parameter, so

* TP=1 and TP=8 start from bitwise the same full tensor (the tiles do not depend on the layout);
* init costs the rank's share of the numbers (plus partial tiles at the shard's edges), not the
  whole tensor, and the extra memory is one tile;
* a parameter's values do not depend on the order in which the model creates its parameters.

Tiles are drawn on the parameter's device with that device's generator, so a CPU and a CUDA run
start from different (but each layout-independent) values, as any torch RNG would.

Init methods passed to layers (``init_method=``) are either

* a :class:`NormalInit` (from :func:`normal_` or :func:`scaled_normal_`), drawn tile by tile as
  above; or
* any callable ``init_method(full_shape) -> Tensor`` returning the full fp32 tensor (the caller
  then owns the seeding, and each rank builds the full tensor to slice it).
"""

from __future__ import annotations

import hashlib
import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Union

import torch

__all__ = ["seed_for", "generator_for", "full_init", "NormalInit", "normal_", "scaled_normal_",
           "draw_full", "init_shard_", "InitMethod", "TILE", "skip_draws"]

#: Logical names whose random draw :func:`init_shard_` skips (see :func:`skip_draws`). A context
#: variable, not an argument, so that the names need not be threaded through every layer's
#: constructor; its default is empty and only :func:`skip_draws` sets it, for one block.
_SKIPPED: ContextVar[frozenset] = ContextVar("paratron_init_skipped", default=frozenset())


@contextmanager
def skip_draws(logical_names):
    """Inside the block, :func:`init_shard_` leaves the params named in ``logical_names``
    uninitialised (``torch.empty``): a checkpoint load is about to fill them ("no init
    before a load"). Draws of every other param are unchanged."""
    token = _SKIPPED.set(frozenset(logical_names))
    try:
        yield
    finally:
        _SKIPPED.reset(token)


#: ``(rows, cols)`` of one init tile in the matrix view (256 KiB of fp32). Changing it changes
#: every initial value, so it is fixed.
TILE = (256, 256)


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


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix view of a full shape: ``[d0, d1*...]``; a vector is one row, a scalar 1x1."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def _matrix_region(shape, offsets, sizes) -> tuple[int, int, int, int]:
    """``(r0, r1, c0, c1)``: the slice ``offsets/sizes`` of ``shape`` in the matrix view.

    Raises:
        ValueError: the slice cuts a dim after the second (not a rectangle of the view).
    """
    if len(shape) == 0:
        return 0, 1, 0, 1
    if len(shape) == 1:
        return 0, 1, offsets[0], offsets[0] + sizes[0]
    if any(o != 0 or n != d for o, n, d in zip(offsets[2:], sizes[2:], shape[2:])):
        raise ValueError(f"an init shard may split only dims 0 and 1; got offsets {offsets}, "
                         f"sizes {sizes} of {shape}")
    inner = math.prod(shape[2:])
    return offsets[0], offsets[0] + sizes[0], offsets[1] * inner, (offsets[1] + sizes[1]) * inner


def _tile_generator(device: torch.device) -> torch.Generator:
    """A generator on ``device``; on the CPU for a device that has none (the device audit's
    PrivateUse1 stand-in), whose tiles are then drawn on the CPU and moved (``.to`` is a no-op
    where the devices agree)."""
    try:
        return torch.Generator(device=device)
    except (RuntimeError, NotImplementedError):
        return torch.Generator()


def _fill_tiles_(out2d: torch.Tensor, region, full_rows_cols, seed: int, logical_name: str,
                 std: float) -> None:
    """Write the ``region`` (``r0, r1, c0, c1``) of the tiled N(0, std^2) matrix into ``out2d``
    (``[r1-r0, c1-c0]``), drawing each overlapping tile whole into one reused buffer."""
    r0, r1, c0, c1 = region
    rows, cols = full_rows_cols
    tr, tc = TILE
    gen = _tile_generator(out2d.device)
    buf = torch.empty(min(tr, rows) * min(tc, cols), dtype=torch.float32, device=gen.device)
    for i in range(r0 // tr, -(-r1 // tr)):
        h = min(tr, rows - i * tr)
        for j in range(c0 // tc, -(-c1 // tc)):
            w = min(tc, cols - j * tc)
            gen.manual_seed(seed_for(seed, f"{logical_name}@tile{i},{j}"))
            tile = buf[:h * w].view(h, w).normal_(0.0, std, generator=gen)
            a, b = max(r0, i * tr), min(r1, i * tr + h)
            c, d = max(c0, j * tc), min(c1, j * tc + w)
            piece = tile[a - i * tr:b - i * tr, c - j * tc:d - j * tc]
            out2d[a - r0:b - r0, c - c0:d - c0] = piece.to(out2d.device)


def normal_slice_(out: torch.Tensor, full_shape, offsets, seed: int, logical_name: str,
                  std: float) -> torch.Tensor:
    """Fill ``out`` (its shape is the slice's size) with the slice at ``offsets`` of the full
    N(0, std^2) tensor of shape ``full_shape`` named ``logical_name``; returns ``out``.

    Raises:
        ValueError: ``std`` is negative; the slice does not fit; it cuts a dim after the second.
    """
    if std < 0:
        raise ValueError(f"init std must be >= 0, got {std} for {logical_name}")
    shape, sizes = tuple(int(s) for s in full_shape), tuple(out.shape)
    if len(offsets) != len(shape) or any(o < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
        raise ValueError(f"{logical_name}: slice at {tuple(offsets)} of size {sizes} does not fit in {shape}")
    if out.numel() == 0 or out.is_meta:
        return out
    region = _matrix_region(shape, tuple(offsets), sizes)
    # Tiles are copied (and cast) straight into ``out``; only a strided view needs a staging copy.
    target = out if out.is_contiguous() else torch.empty(sizes, dtype=out.dtype, device=out.device)
    with torch.no_grad():
        _fill_tiles_(target.view(region[1] - region[0], region[3] - region[2]), region, _matrix_shape(shape),
                     seed, logical_name, std)
        if target is not out:
            out.copy_(target)
    return out


def full_init(shape, seed: int, logical_name: str, std: float) -> torch.Tensor:
    """The full fp32 tensor of one parameter, ~ N(0, std^2), drawn on the CPU (tile by tile, so
    it equals the union of every rank's :func:`init_shard_`).

    Args:
        shape: the full logical shape (e.g. ``(out, in)`` of a linear weight, vocab unpadded).
        seed: the run's seed (``train.seed``).
        logical_name: the layout-independent parameter name, e.g. ``layers.0.mlp.fc1.weight``.
        std: standard deviation.
    Raises:
        ValueError: ``std`` is negative.
    """
    out = torch.empty(tuple(int(s) for s in shape), dtype=torch.float32)
    return normal_slice_(out, out.shape, (0,) * out.dim(), seed, logical_name, std)


@dataclass(frozen=True)
class NormalInit:
    """N(0, std^2) drawn tile by tile from ``(seed, logical_name, tile)`` generators."""

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


def init_shard_(out: torch.Tensor, init_method: InitMethod | None, spec, seed: int, logical_name: str,
                block_names: tuple[str, ...] | None = None) -> torch.Tensor:
    """Fill ``out`` (a rank's local tensor; padding rows are left as they are) with its
    :class:`~paratron.parallel.params.ShardSpec` ``spec``'s slice of the full initial tensor,
    drawing only the tiles that overlap the slice, on ``out``'s device; returns ``out``.

    Args:
        out: the local tensor, ``spec.valid(out)`` is written (any float dtype; cast per tile).
        init_method: as for the layers (default ``normal_(0.02)``); a plain callable builds the
            full tensor and slices it.
        spec: this rank's slice; with ``spec.stride > 1`` each fused block is its own full tensor.
        seed: the run's seed.
        logical_name: the parameter's logical name (e.g. ``layers.0.mlp.fc1.weight``).
        block_names: with a strided ``spec``, one logical name per fused block whose tiles draw
            that block (SwiGLU's ``gate``/``up``); None draws the fused tensor as one.
    Inside :func:`skip_draws` naming ``logical_name``, ``out`` is returned as it is.

    Raises:
        ValueError: ``block_names`` does not match ``spec.stride``; see :func:`normal_slice_`.
    """
    if logical_name in _SKIPPED.get():
        return out
    method = init_method if init_method is not None else normal_()
    if block_names is not None and len(block_names) != spec.stride:
        raise ValueError(f"{logical_name}: {len(block_names)} block names for stride {spec.stride}")
    valid = spec.valid(out)
    if not isinstance(method, NormalInit):
        names = block_names or (logical_name,)
        rows = (spec.global_shape[0] // len(names),) + tuple(spec.global_shape[1:])
        full = torch.cat([draw_full(method, rows, seed, n) for n in names])
        with torch.no_grad():
            valid.copy_(full[spec.slices()])
        return out
    block_rows = spec.global_shape[0] // spec.stride
    for k, (row, piece) in enumerate(spec.blocks()):
        dst = valid[row:row + piece.local_shape[0]]
        if block_names is None:
            normal_slice_(dst, spec.global_shape, piece.offsets, seed, logical_name, method.std)
        else:
            normal_slice_(dst, (block_rows,) + tuple(spec.global_shape[1:]),
                          (piece.offsets[0] - k * block_rows,) + tuple(piece.offsets[1:]),
                          seed, block_names[k], method.std)
    return out
