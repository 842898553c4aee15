"""Rules of the observability options (``train.profile_steps``, ``profile_ranks``,
``memory_snapshot_steps``, ``timeline_steps``, ``wandb_project``), checked with the rest of the
config before any process exists."""

from __future__ import annotations

import importlib.util

from .errors import ConfigError
from .sections import Config

WANDB_HINT = "pip install 'paratron[wandb]'"
"""How to get the optional Weights & Biases package (the extra that holds it)."""


def check_observability(cfg: Config, world: int | None) -> None:
    """Raises ConfigError naming the field and the rule; a set ``train.wandb_project`` without
    the ``wandb`` package is refused here, before launch, naming the extra."""
    t = cfg.train
    if t.profile_steps and (len(t.profile_steps) != 2 or not 1 <= t.profile_steps[0] <= t.profile_steps[1]):
        raise ConfigError(f"train.profile_steps={t.profile_steps} must be [start, end] with 1 <= start <= end "
                          "(1-based steps, both profiled), or [] for no profiler")
    for name in ("memory_snapshot_steps", "timeline_steps"):
        bad = [s for s in getattr(t, name) if s < 1]
        if bad:
            raise ConfigError(f"train.{name}={getattr(t, name)}: steps count from 1, got {bad}")
    bad_ranks = [r for r in t.profile_ranks if r < 0 or (world is not None and r >= world)]
    if bad_ranks:
        raise ConfigError(f"train.profile_ranks={t.profile_ranks}: ranks {bad_ranks} are not in the world "
                          f"of {world if world is not None else 'any'} ranks")
    if t.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"train.wandb_project={t.wandb_project!r} needs the wandb package, which is not "
                          f"installed: {WANDB_HINT}")
