"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD decay.

Step ``n`` (0-based, the optimizer step about to run) gets

* warmup, ``n < W``: ``lr * (n + 1) / W`` (so the last warmup step reaches ``lr``);
* decay, ``W <= n < D`` with ratio ``r = (n - W) / (D - W)``:
  cosine ``min + (lr - min) * (1 + cos(pi r)) / 2`` (Loshchilov & Hutter 2017, SGDR, without
  restarts); linear ``lr - (lr - min) r``; constant ``lr``;
  WSD (warmup-stable-decay, Hu et al. 2024, MiniCPM section 4): ``lr`` until ``D - K``, then
  linear to ``min`` over the last ``K`` steps;
* after ``D``: ``min`` (``lr`` for constant).

With ``W > D`` the warmup rule holds for every step below ``W``, so a run shorter than its warmup
never decays.

``W = lr_warmup_iters``, ``D = lr_decay_iters`` (default ``train_iters``),
``K = lr_wsd_decay_iters`` (default 10% of ``D``).
"""

from __future__ import annotations

import math

STYLES = ("cosine", "linear", "constant", "wsd")


def wsd_iters(decay_iters: int, wsd_decay_iters: int | None) -> int:
    """``K``: ``wsd_decay_iters``, or 10% of ``decay_iters`` (at least 1) when unset."""
    return max(1, decay_iters // 10) if wsd_decay_iters is None else wsd_decay_iters


def check_lr_schedule(lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                      style: str = "cosine", wsd_decay_iters: int | None = None) -> None:
    """The rules of a schedule (:class:`LRScheduler`'s arguments); pure, so the config validator
    runs it before any process group exists and the constructor runs it again.

    Raises:
        ValueError: unknown style, negative lr, min_lr > lr, negative warmup, or (WSD) a decay
            phase ``K`` outside ``(0, D - W]`` when the warmup ends before ``D``.
    """
    if style not in STYLES:
        raise ValueError(f"optimizer.lr_decay_style={style!r} must be one of {STYLES}")
    if lr < 0 or min_lr < 0:
        raise ValueError(f"optimizer.lr={lr} and optimizer.min_lr={min_lr} must be >= 0")
    if min_lr > lr:
        raise ValueError(f"optimizer.min_lr={min_lr} must be <= optimizer.lr={lr}")
    if warmup_iters < 0:
        raise ValueError(f"optimizer.lr_warmup_iters={warmup_iters} must be >= 0")
    k = wsd_iters(decay_iters, wsd_decay_iters)
    # A warmup longer than the decay (a short smoke run of a long config) is allowed, as in
    # Megatron-LM: the lr rises for the whole run and never decays.
    if style == "wsd" and warmup_iters < decay_iters and not 0 < k <= decay_iters - warmup_iters:
        raise ValueError(f"optimizer.lr_wsd_decay_iters={k} must be in "
                         f"(0, lr_decay_iters - lr_warmup_iters = {decay_iters - warmup_iters}]")


class LRScheduler:
    """Computes the lr of each step and, when given an optimizer, sets it.

    Args:
        lr, min_lr: peak and final lr.
        warmup_iters, decay_iters: ``W`` and ``D`` above.
        style: one of ``cosine``, ``linear``, ``constant``, ``wsd``.
        wsd_decay_iters: ``K`` above (WSD only).
        optimizer: anything with ``set_lr(lr)``; updated on construction and every :meth:`step`.

    Raises:
        ValueError: a rule of :func:`check_lr_schedule`.
    """

    def __init__(self, lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                 style: str = "cosine", wsd_decay_iters: int | None = None, optimizer=None) -> None:
        check_lr_schedule(lr, min_lr, warmup_iters, decay_iters, style, wsd_decay_iters)
        wsd_decay_iters = wsd_iters(decay_iters, wsd_decay_iters)
        self.max_lr, self.min_lr = float(lr), float(min_lr)
        self.warmup_iters, self.decay_iters = int(warmup_iters), int(decay_iters)
        self.style, self.wsd_decay_iters = style, int(wsd_decay_iters)
        self.optimizer = optimizer
        self.num_steps = 0
        self._apply()

    def lr_at(self, n: int) -> float:
        """The lr of (0-based) step ``n``."""
        W, D, top, low = self.warmup_iters, self.decay_iters, self.max_lr, self.min_lr
        if n < W:
            return top * (n + 1) / W
        if self.style == "constant":
            return top
        if n >= D:
            return low
        if self.style == "wsd":
            start = D - self.wsd_decay_iters
            if n < start:
                return top
            return top - (top - low) * (n - start) / self.wsd_decay_iters
        r = (n - W) / max(D - W, 1)
        if self.style == "linear":
            return top - (top - low) * r
        return low + (top - low) * 0.5 * (1.0 + math.cos(math.pi * r))

    @property
    def lr(self) -> float:
        """The lr of the current step."""
        return self.lr_at(self.num_steps)

    def step(self, increment: int = 1) -> float:
        """Advance to the next step (call after each optimizer step); returns the new lr."""
        self.num_steps += int(increment)
        self._apply()
        return self.lr

    def _apply(self) -> None:
        if self.optimizer is not None:
            self.optimizer.set_lr(self.lr)

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, d: dict) -> None:
        self.num_steps = int(d["num_steps"])
        self._apply()


def schedule_arguments(opt_cfg, train_iters: int) -> tuple:
    """``(lr, min_lr, warmup_iters, decay_iters, style, wsd_decay_iters)`` of
    :class:`paratron.config.OptimizerConfig` ``opt_cfg`` for a run of ``train_iters`` steps
    (``lr_decay_iters`` defaults to it)."""
    decay = opt_cfg.lr_decay_iters if opt_cfg.lr_decay_iters is not None else train_iters
    return (opt_cfg.lr, opt_cfg.min_lr, opt_cfg.lr_warmup_iters, decay, opt_cfg.lr_decay_style,
            opt_cfg.lr_wsd_decay_iters)


def check_lr_config(opt_cfg, train_iters: int) -> None:
    """:func:`check_lr_schedule` of a config's schedule (see :func:`schedule_arguments`).

    Raises:
        ValueError: as :func:`check_lr_schedule`.
    """
    check_lr_schedule(*schedule_arguments(opt_cfg, train_iters))


def build_lr_scheduler(opt_cfg, train_iters: int, optimizer=None) -> LRScheduler:
    """The schedule of :class:`paratron.config.OptimizerConfig` ``opt_cfg`` for a run of
    ``train_iters`` steps (see :func:`schedule_arguments` and :class:`LRScheduler`)."""
    return LRScheduler(*schedule_arguments(opt_cfg, train_iters), optimizer=optimizer)
