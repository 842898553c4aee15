"""Run configuration: dataclasses, TOML loading, ``--set section.key=value`` overrides, validation.

A run is described by one :class:`Config` with seven sections (model, parallel, train, optimizer,
data, checkpoint, logging), each field documented under it (:mod:`.sections`). Files and
overrides are read by :mod:`.loading`; every rule is a small named validator in
:data:`VALIDATORS` (:mod:`.validators`); :func:`validate` runs them all *before* any process group
exists. Megatron-LM's flags are accepted as aliases (:mod:`.aliases`).
"""

from .aliases import MEGATRON_ALIASES, MEGATRON_SWITCHES, build_config, finish_aliases, megatron_overrides
from .errors import ConfigError
from .loading import apply_overrides, from_dict, load_config, set_value, to_toml
from .validators import VALIDATORS, validate
from .sections import (SECTIONS, CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig,
                       OptimizerConfig, ParallelConfig, TrainConfig)

__all__ = [
    "MEGATRON_ALIASES", "MEGATRON_SWITCHES", "build_config", "finish_aliases", "megatron_overrides",
    "ConfigError", "apply_overrides", "from_dict", "load_config", "set_value", "to_toml",
    "VALIDATORS", "validate", "SECTIONS", "CheckpointConfig", "Config", "DataConfig",
    "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "TrainConfig",
]
