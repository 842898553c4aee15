"""Rules of token-balanced microbatches (``data.microbatch_tokens``) that ask other packages: the
data-path parser (:func:`paratron.data.prepare.parse_data_path`) and the registered schedules.
The config's own rules of the mode are :func:`paratron.config.token_rules.check_microbatch_tokens`."""

from __future__ import annotations

from paratron.config.sections import Config
from paratron.config.token_rules import token_balanced
from paratron.data.prepare import parse_data_path
from paratron.errors import ConfigError
from paratron.pipeline.registry import get_schedule


def _one_prefix(cfg: Config) -> None:
    name = f"data.microbatch_tokens={cfg.data.microbatch_tokens}"
    try:
        prefixes = parse_data_path(cfg.data.data_path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if len(prefixes) > 1:
        raise ConfigError(f"{name} with {len(prefixes)} data.data_path prefixes: token-balanced microbatches read "
                          "whole documents of one dataset; merge them (paratron preprocess) or use one prefix")


def _any_count(cfg: Config, world: int | None) -> None:
    """The microbatch count changes from step to step, so the schedule must take any count (from
    1 to ``2 * p * v``, checked); the global batch must give every DP rank a microbatch."""
    p, t = cfg.parallel, cfg.train
    spec = get_schedule(p.schedule)
    for m in range(1, 2 * p.pipeline * p.virtual_pipeline + 1):
        try:
            spec.accepts(p.pipeline, m, p.virtual_pipeline)
        except ValueError as e:
            raise ConfigError(f"data.microbatch_tokens={cfg.data.microbatch_tokens} gives a microbatch count that "
                              f"varies per step, but parallel.schedule={p.schedule!r} (parallel.pipeline="
                              f"{p.pipeline}, parallel.virtual_pipeline={p.virtual_pipeline}) refuses {m} "
                              f"microbatches: {e}") from None
    mp = p.tensor * p.context * p.pipeline
    if world is not None and world % mp == 0 and t.global_batch_size < world // mp:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} documents is below the data-parallel "
                          f"size {world // mp}: every DP rank needs at least one document per step")


def check_token_layout(cfg: Config, world: int | None) -> None:
    """With ``data.microbatch_tokens``: one data prefix (a blend is not read by whole documents),
    a schedule that takes any microbatch count, at least one document per DP rank.

    Raises:
        ConfigError: the first rule broken.
    """
    if not token_balanced(cfg):
        return
    _one_prefix(cfg)
    _any_count(cfg, world)
