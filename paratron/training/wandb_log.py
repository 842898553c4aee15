"""Weights & Biases logging (``train.wandb_project``, Megatron's ``--wandb-project`` /
``--wandb-exp-name``): rank 0 logs the records it writes to TensorBoard, with the run's config.

``wandb`` is an optional extra (``pip install 'paratron[wandb]'``); config validation refuses
``train.wandb_project`` without it before launch (:mod:`paratron.config.observe_rules`).
``WANDB_MODE=offline`` makes wandb write the run under ``RUN_DIR/wandb/`` only (``wandb sync``
uploads it later).
"""

from __future__ import annotations

from pathlib import Path

from paratron.config import Config, ConfigError
from paratron.config.observe_rules import WANDB_HINT
from paratron.training.metrics import scalars


class WandbWriter:
    """A :class:`~paratron.training.metrics.MetricsWriter` sink: each record's
    :func:`~paratron.training.metrics.scalars` go to ``wandb.log`` at the record's iteration.

    Raises:
        ConfigError: ``wandb`` is not installed (naming the extra).
    """

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(f"train.wandb_project is set but wandb is not installed: {WANDB_HINT}") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.train.wandb_project, name=cfg.train.wandb_exp_name,
                              dir=str(run_dir), config=cfg.to_dict())

    def write(self, record: dict) -> None:
        step, values = scalars(record)
        if values:
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_sinks(cfg: Config, run_dir: Path, rank: int) -> list:
    """The metrics sinks of ``train.wandb_project``: a :class:`WandbWriter` on rank 0, else none."""
    if cfg.train.wandb_project is None or rank != 0:
        return []
    return [WandbWriter(cfg, run_dir)]
