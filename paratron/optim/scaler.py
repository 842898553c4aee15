"""Loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2).

The loss is multiplied by a scale before backward so small fp16 grads do not flush to zero; the
optimizer divides the fp32 main grads by it again. :class:`DynamicLossScaler` halves the scale
after ``hysteresis`` overflowing steps (every overflowing step is skipped) and doubles it after
``growth_interval`` clean steps in a row, as Megatron's ``DynamicGradScaler`` does. The overflow
flag it receives must already be global (see :mod:`paratron.optim.optimizer`), so every rank
updates the scale identically.
"""

from __future__ import annotations


class ConstantLossScaler:
    """A fixed scale (1.0 for fp32 and bf16 training): never skips a step."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """Nothing changes (a non-finite fp32/bf16 step is skipped by the optimizer and judged
        by the training loop's ``train.nonfinite`` policy, not by a scale)."""

    def state_dict(self) -> dict:
        return {"loss_scale": self.scale}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d.get("loss_scale", self.scale))


def check_loss_scale(initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int,
                     growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
    """The rules of :class:`DynamicLossScaler`'s arguments; pure, so the config validator runs it
    (for ``train.precision = "fp16"``, the one precision that builds the scaler) before any
    process group exists, and the constructor runs it again.

    Raises:
        ValueError: a non-positive scale, interval or hysteresis, min_scale > initial_scale, or
            growth/backoff factors outside ``> 1`` / ``(0, 1)``.
    """
    for name, v in (("optimizer.initial_loss_scale", initial_scale),
                    ("optimizer.min_loss_scale", min_scale),
                    ("optimizer.loss_scale_window", growth_interval),
                    ("optimizer.hysteresis", hysteresis)):
        if v <= 0:
            raise ValueError(f"{name}={v} must be > 0")
    if min_scale > initial_scale:
        raise ValueError(f"optimizer.min_loss_scale={min_scale} must be <= "
                         f"optimizer.initial_loss_scale={initial_scale}")
    if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0):
        raise ValueError("growth_factor must be > 1 and backoff_factor in (0, 1)")


def check_loss_scale_config(opt_cfg) -> None:
    """:func:`check_loss_scale` of :class:`paratron.config.OptimizerConfig` ``opt_cfg``'s fields.

    Raises:
        ValueError: as :func:`check_loss_scale`.
    """
    check_loss_scale(opt_cfg.initial_loss_scale, opt_cfg.min_loss_scale, opt_cfg.loss_scale_window,
                     opt_cfg.hysteresis)


class DynamicLossScaler:
    """Dynamic loss scale with hysteresis.

    Args:
        initial_scale: scale of the first step (``optimizer.initial_loss_scale``).
        min_scale: the scale never drops below this (``optimizer.min_loss_scale``).
        growth_interval: clean steps in a row before the scale doubles
            (``optimizer.loss_scale_window``).
        hysteresis: overflowing steps (not necessarily in a row) before the scale halves; reset
            whenever the scale grows (``optimizer.hysteresis``).
        growth_factor, backoff_factor: x2 and x0.5.

    Raises:
        ValueError: a rule of :func:`check_loss_scale`.
    """

    dynamic = True

    def __init__(self, initial_scale: float = 2.0**16, min_scale: float = 1.0,
                 growth_interval: int = 1000, hysteresis: int = 2, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5) -> None:
        check_loss_scale(initial_scale, min_scale, growth_interval, hysteresis, growth_factor, backoff_factor)
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Advance by one step whose (global) overflow flag is ``found_inf``."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"loss_scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, d: dict) -> None:
        self.scale = float(d["loss_scale"])
        self.growth_tracker = int(d.get("growth_tracker", 0))
        self.hysteresis_tracker = int(d.get("hysteresis_tracker", self.hysteresis))
