"""RNG streams for tensor parallelism (Shoeybi et al. 2019, section 3, "Hybrid model and data
parallelism": dropout inside a TP region must differ across TP ranks, dropout on replicated
activations must agree).

A :class:`RNGStatesTracker` owns named RNG states. The default stream (PyTorch's global CPU and
CUDA generators) is seeded identically on every TP rank of a pipeline stage; inside
``with tracker.fork("model-parallel"):`` the global generators temporarily run a stream seeded
per TP rank, and its advanced state is kept for the next fork. There is no global tracker: the
model owns one (docs/DESIGN.md principle 2).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .context import ParallelContext

__all__ = ["RNGStatesTracker", "MODEL_PARALLEL_RNG", "MODEL_PARALLEL_SEED_OFFSET"]

MODEL_PARALLEL_RNG = "model-parallel"
MODEL_PARALLEL_SEED_OFFSET = 2718
"""Added to the seed for the per-TP-rank stream (the offset Megatron-LM uses)."""
PIPELINE_SEED_STRIDE = 100
"""Stages of a pipeline draw different dropout masks: seed + 100 * pp_rank (as Megatron-LM)."""


def capture_default_states() -> dict[str, torch.Tensor]:
    """The states of PyTorch's global generators (CPU, and CUDA when present)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_default_states(state: dict[str, torch.Tensor]) -> None:
    """Set PyTorch's global generators to ``state`` (from :func:`capture_default_states`)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seeded(seed: int) -> dict[str, torch.Tensor]:
    """The generator states that ``manual_seed(seed)`` produces, without disturbing the current ones."""
    saved = capture_default_states()
    try:
        torch.manual_seed(seed)  # seeds CPU and every CUDA device
        return capture_default_states()
    finally:
        restore_default_states(saved)


class RNGStatesTracker:
    """Named RNG streams for one rank.

    Args:
        seed: the run's seed (``train.seed``).
        ctx: the parallel context; the TP and PP ranks choose the streams.

    Streams:
        default: ``seed + 100 * pp_rank``, identical on every TP rank (and DP rank) of a stage;
            applied to PyTorch's global generators by :meth:`seed_default_stream`.
        ``"model-parallel"``: ``seed + 100 * pp_rank + 2718 + tp_rank``, for dropout inside TP
            regions (e.g. on attention probabilities of this rank's heads).

    Raises:
        ValueError: :meth:`add` of an existing name; :meth:`fork` of an unknown name.
    """

    def __init__(self, seed: int, ctx: ParallelContext):
        self.base_seed = int(seed) + PIPELINE_SEED_STRIDE * max(ctx.pp.rank, 0)
        self.tp_rank = max(ctx.tp.rank, 0)
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._seeds: dict[str, int] = {}
        self.add(MODEL_PARALLEL_RNG, self.base_seed + MODEL_PARALLEL_SEED_OFFSET + self.tp_rank)

    def seed_default_stream(self) -> None:
        """Seed PyTorch's global CPU/CUDA generators with the default stream's seed (identical on
        every TP rank). Call once at model setup, before any dropout."""
        torch.manual_seed(self.base_seed)

    def add(self, name: str, seed: int) -> None:
        """Register a stream ``name`` seeded with ``seed`` (e.g. an expert-parallel stream)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists (seed {self._seeds[name]})")
        self._seeds[name] = int(seed)
        self._states[name] = _seeded(int(seed))

    def names(self) -> list[str]:
        return sorted(self._states)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block on stream ``name``; the default stream resumes unchanged afterwards."""
        if name not in self._states:
            raise ValueError(f"unknown RNG stream {name!r}; known: {self.names()}")
        outer = capture_default_states()
        restore_default_states(self._states[name])
        try:
            yield
        finally:
            self._states[name] = capture_default_states()
            restore_default_states(outer)

    def get_states(self, include_default: bool = True) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of every stream's state (``{"cpu": ByteTensor, "cuda": ByteTensor?}`` each);
        with ``include_default`` also the global generators under ``"default"``. Used to save
        checkpoints and to replay dropout masks in activation recomputation."""
        out = {k: {d: t.clone() for d, t in v.items()} for k, v in self._states.items()}
        if include_default:
            out["default"] = capture_default_states()
        return out

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        """Restore states from :meth:`get_states` (a ``"default"`` entry resets the global generators).

        Raises:
            ValueError: a named stream this tracker does not know.
        """
        unknown = sorted(set(states) - set(self._states) - {"default"})
        if unknown:
            raise ValueError(f"unknown RNG streams {unknown}; known: {self.names()}")
        for name, st in states.items():
            if name == "default":
                restore_default_states(st)
            else:
                self._states[name] = {d: t.clone() for d, t in st.items()}
