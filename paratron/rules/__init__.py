"""Every rule of a run's config, in one order, run before any process group exists; and the
config as a run loads it (with the defaults a registered schedule implies).

The config package (:mod:`paratron.config`) is a leaf: sections, loading, Megatron aliases, the
model shape and the rules that read the config alone (:mod:`paratron.config.validators`). The
rules that ask a package owning the concept (the rank grid, the pipeline split and schedules, the
token dispatchers, the optimizer's schedule, loss scale and ZeRO level, the checkpoint manager)
live here, above all of them, each a call of the owner's pure check (:mod:`.layout`,
:mod:`.tokens`, :mod:`.owners`). The train command, ``paratron info``, the planner and the dry
run validate through :func:`validate`.
"""

from __future__ import annotations

from pathlib import Path

from paratron.config import aliases, loading
from paratron.config.errors import ConfigError
from paratron.config.sections import Config
from paratron.config.validators import SECTION_RULES, config_warnings

from .layout import _grid, _pipeline_layers, _schedule, check_schedule, imply_schedule_defaults
from .owners import _checkpoint, _dispatcher, _loss_scale, _lr_schedule, _moe_fb_overlap, _zero
from .tokens import check_token_layout

_r = SECTION_RULES
VALIDATORS = [
    _r["_finite"], _r["_positive"], _r["_nonfinite_policy"], _lr_schedule, _loss_scale, _checkpoint, _grid,
    _r["_model"], _r["_activation_offload"], _r["_batch"], _r["_sequence"], _r["_link_latency"], _schedule,
    _pipeline_layers, _r["_mtp_last_stage"], _r["_dualpipev_zero3"], _r["_experts"], _dispatcher,
    _moe_fb_overlap, _zero, _r["_fp8"], _r["_save_peft"], _r["_split"], _r["check_context"],
    _r["check_microbatch_tokens"], check_token_layout, _r["check_observability"], _r["check_records"],
    _r["check_low_rank"], _r["_encoder_placement"], _r["check_failslow"],
]
"""Every config rule, in order. Each takes ``(cfg, world_size_or_None)`` and raises ConfigError."""
del _r


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Run every rule of :data:`VALIDATORS`; call before creating any process group (and after
    importing the plugins of ``train.callbacks``, whose schedules, dispatchers and blocks are
    looked up here).

    ``world_size``: the launch's; the ``train.elastic_spares`` standing by are not in the layout.

    Raises:
        ConfigError: the first rule broken, naming field, value and rule.
    """
    training = _training_world(cfg, world_size)
    for rule in VALIDATORS:
        try:
            rule(cfg, training)
        except ConfigError as e:
            if training == world_size or f"world size {training}" not in str(e):
                raise
            raise ConfigError(f"{e} (world size {training}: the launch's {world_size} ranks less "
                              f"train.elastic_spares={cfg.train.elastic_spares})") from None
    return cfg


def _training_world(cfg: Config, world_size: int | None) -> int | None:
    """The ranks that train at the start: the launch's less the elastic spares."""
    t = cfg.train
    if t.elastic_spares < 0:
        raise ConfigError(f"train.elastic_spares={t.elastic_spares} must be >= 0")
    if t.elastic_spares and not t.elastic_relayout:
        raise ConfigError(f"train.elastic_spares={t.elastic_spares} needs train.elastic_relayout=true "
                          "(the spares join at a re-layout)")
    if world_size is None or not t.elastic_spares:
        return world_size
    if t.elastic_spares >= world_size:
        raise ConfigError(f"train.elastic_spares={t.elastic_spares} leaves no training rank of the "
                          f"world size {world_size}")
    return world_size - t.elastic_spares


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """:func:`paratron.config.loading.load_config` with the chunk count a fixed-chunk schedule
    implies (:func:`.layout.imply_schedule_defaults`).

    Raises:
        ConfigError: a missing or malformed file, an unknown key, a value of the wrong type.
    """
    return loading.load_config(path, overrides, implied=imply_schedule_defaults)


def build_config(path: str | Path | None, overrides: list[str]) -> Config:
    """:func:`paratron.config.aliases.build_config` (file, overrides, Megatron aliases) with the
    chunk count a fixed-chunk schedule implies.

    Raises:
        ConfigError: as :func:`load_config`, or a derived Megatron alias that does not fit.
    """
    return aliases.build_config(path, overrides, implied=imply_schedule_defaults)


__all__ = ["VALIDATORS", "validate", "load_config", "build_config", "check_schedule", "config_warnings",
           "imply_schedule_defaults"]
