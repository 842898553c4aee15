"""Per-rank RNG states in a checkpoint: restored exactly when the layout is unchanged, re-derived
deterministically when it changed.

Same layout (same world size, TP/CP/EP/PP/DP sizes, expert TP and rank order): every rank gets
back the states it saved: PyTorch's global CPU generator, the CUDA generator when present, and
every stream of the model's :class:`~paratron.parallel.random.RNGStatesTracker`. The resumed run
then draws exactly what the uninterrupted run would have drawn.

Changed layout: a rank's saved states belong to a rank position that no longer exists, so every
stream is re-seeded as if the run had started with ``derived_seed(seed, step)``, using the same
formulas the tracker uses at start-up (default stream ``seed' + 100 * pp_rank``, identical on TP
and DP replicas; model-parallel stream ``seed' + 100 * pp_rank + 2718 + tp_rank``). The result is a
function of (seed, step, rank coordinates) only: reproducible, consistent across TP replicas,
and different from the streams used before the save. Dropout masks after such a resume differ
from the uninterrupted run's (no layout-independent dropout exists), which is why exact resume is
only promised for an unchanged layout.
"""

from __future__ import annotations

import hashlib

import torch

from paratron.parallel.random import RNGStatesTracker

from paratron.parallel.context import ParallelContext


def layout_signature(ctx: ParallelContext, config=None) -> dict:
    """The rank-grid description that decides whether saved per-rank states still apply."""
    g = ctx.grid
    sig = {"world": g.world, "tp": g.tp, "cp": g.cp, "ep": g.ep, "pp": g.pp, "dp": g.dp,
           "expert_tp": g.expert_tp, "order": "-".join(g.order)}
    if config is not None:
        sig["virtual_pipeline"] = config.parallel.virtual_pipeline
    return sig


def rank_coordinates(ctx: ParallelContext) -> dict:
    """This rank's index in each group (what the RNG streams are seeded from)."""
    return {k: ctx.group(k).rank for k in ("tp", "cp", "ep", "pp", "dp", "expert_tp", "expert_dp")}


def find_tracker(chunks):
    """The model's RNG tracker (an ``rng_tracker`` attribute of a chunk), or None."""
    if isinstance(chunks, torch.nn.Module):
        chunks = [chunks]
    for c in chunks:
        tracker = getattr(c, "rng_tracker", None)
        if tracker is not None:
            return tracker
    return None


def capture(chunks) -> dict:
    """``{stream: {"cpu": ByteTensor, "cuda"?: ByteTensor}}``; ``"default"`` is the global one."""
    tracker = find_tracker(chunks)
    if tracker is not None:
        return tracker.get_states(include_default=True)
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return {"default": state}


def restore(chunks, states: dict) -> None:
    """Put back the states of :func:`capture` (a ``cuda`` state is skipped without CUDA)."""
    if not torch.cuda.is_available():
        states = {k: {d: t for d, t in v.items() if d != "cuda"} for k, v in states.items()}
    tracker = find_tracker(chunks)
    if tracker is not None:
        tracker.set_states(states)
        return
    default = states.get("default", {})
    if "cpu" in default:
        torch.set_rng_state(default["cpu"])
    if "cuda" in default:
        torch.cuda.set_rng_state(default["cuda"])


def derived_seed(seed: int, step: int) -> int:
    """A 31-bit seed that is a fixed function of ``(seed, step)``."""
    digest = hashlib.sha256(f"paratron-resume:{int(seed)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def rederive(chunks, ctx: ParallelContext, seed: int, step: int) -> int:
    """Re-seed the global generators and every tracker stream from ``derived_seed(seed, step)``
    and this rank's coordinates (see the module docstring). Returns the derived seed."""
    new_seed = derived_seed(seed, step)
    fresh = RNGStatesTracker(new_seed, ctx)
    tracker = find_tracker(chunks)
    if tracker is not None:
        states = fresh.get_states(include_default=False)
        seeds = getattr(tracker, "_seeds", {})  # the tracker exposes no public seed lookup
        for name in tracker.names():
            if name not in states and name in seeds:
                # Streams added after construction (e.g. per expert rank) keep their offset from
                # the base seed, which encodes this rank's coordinates, moved to the derived seed.
                fresh.add(name, fresh.base_seed + seeds[name] - tracker.base_seed)
        tracker.set_states(fresh.get_states(include_default=False))
    fresh.seed_default_stream()
    return new_seed
