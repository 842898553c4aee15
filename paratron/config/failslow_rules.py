"""Rules of the fail-slow plugin's escalation keys (``train.failslow_relayout``,
``failslow_restart`` and their costs; :mod:`paratron.plugins.failslow`), checked before any
process exists."""

from __future__ import annotations

from .errors import ConfigError
from .sections import Config


def check_failslow(cfg: Config, world: int | None) -> None:
    """Raises ConfigError naming the field and the rule: level 3 needs ``train.elastic_relayout``
    (the online re-layout it applies), level 4 needs level 3, and the costs are seconds >= 0.
    Level 4's save needs no rule here: ``paratron train`` always has a ``checkpoint.save`` (it
    defaults to ``RUN_DIR/checkpoints``, ``training.preflight.apply_run_dir_defaults``), and this
    check runs before that default is filled in."""
    t = cfg.train
    if t.failslow_relayout and not t.elastic_relayout:
        raise ConfigError("train.failslow_relayout=true needs train.elastic_relayout=true (the online "
                          "re-layout it applies; docs/elastic.md)")
    if t.failslow_restart and not t.failslow_relayout:
        raise ConfigError("train.failslow_restart=true needs train.failslow_relayout=true (level 4 follows "
                          "a level-3 re-layout that did not suffice)")
    for name in ("failslow_relayout_cost_s", "failslow_restart_cost_s"):
        value = getattr(t, name)
        if value is not None and not value >= 0:
            raise ConfigError(f"train.{name}={value} must be seconds >= 0")
