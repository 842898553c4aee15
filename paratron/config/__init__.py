"""Run configuration: dataclasses, TOML loading, ``--set section.key=value`` overrides, the rules
that read the config alone.

A run is described by one :class:`Config` with seven sections (model, parallel, train, optimizer,
data, checkpoint, logging), each field documented under it (:mod:`.sections`). Files and
overrides are read by :mod:`.loading`; Megatron-LM's flags are accepted as aliases
(:mod:`.aliases`); the model's shape rules are :mod:`.model_shape`. The config imports no other
paratron package: the rules that ask the packages above it, every rule in order, and the loading
a run uses (with the defaults a schedule implies) are :mod:`paratron.rules` (``validate``,
``load_config``, ``build_config``), run *before* any process group exists.
"""

from .aliases import MEGATRON_ALIASES, MEGATRON_SWITCHES, finish_aliases, megatron_overrides
from .errors import ConfigError
from .loading import apply_overrides, from_dict, set_value, to_toml
from .sections import (SECTIONS, CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig,
                       OptimizerConfig, ParallelConfig, TrainConfig)

__all__ = [
    "MEGATRON_ALIASES", "MEGATRON_SWITCHES", "finish_aliases", "megatron_overrides",
    "ConfigError", "apply_overrides", "from_dict", "set_value", "to_toml",
    "SECTIONS", "CheckpointConfig", "Config", "DataConfig",
    "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "TrainConfig",
]
