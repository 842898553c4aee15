"""Every layout the config validator accepts, for a model, world size and global batch.

The planner has no rules of its own: it proposes each combination of axis sizes (divisors of the
world size), ZeRO level, registered schedule, virtual stages, microbatch size, recompute mode,
sequence parallelism and context-parallel algorithm, and keeps those that the rules of
:data:`paratron.config.VALIDATORS` accept. So a ZeRO level or a context-parallel size becomes
plannable the day the validator starts accepting it.

One rule is deferred: the schedule rule builds and proves the schedule's action lists (seconds
for p = 64, m = 512), so enumeration runs only the schedule's cheap ``check`` and the search
(:mod:`.search`) builds and proves the lists, through :class:`~.pipeline.ScheduleCache`, for
each layout it costs; a layout whose lists fail is dropped there. Every plan printed has passed
every rule.
"""

from __future__ import annotations

import copy
import itertools
from typing import Iterator

from paratron.config import VALIDATORS, Config, ConfigError
from paratron.config.validators import check_schedule
from paratron.pipeline.registry import SCHEDULES

from .layout import Layout, apply

ZERO_LEVELS = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")
CONTEXT_ALGORITHMS = ("ring", "all2all")
DEFERRED_RULES = ("_schedule",)
"""Validator rules run lazily by the search (they build the schedule's lists)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _axes(cfg: Config, world: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(tp, cp, pp, dp, ep) with tp * cp * pp * dp = world."""
    experts = cfg.model.num_experts
    for tp in divisors(world):
        for cp in divisors(world // tp):
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                for ep in (divisors(world // pp) if experts else [1]):
                    yield tp, cp, pp, dp, ep


def _cheap_schedule_rule(cfg: Config, world: int) -> None:
    """The deferred rule's fast part: the schedule exists, its chunk count, its own ``check``."""
    check_schedule(cfg, world, build=False)


def accepted(cfg: Config, world: int) -> tuple[int, str] | None:
    """None when the validator's rules (the deferred one by its fast part) accept ``cfg`` on
    ``world`` ranks, else (how many rules it passed first, the rule broken)."""
    for i, rule in enumerate(VALIDATORS):
        try:
            (_cheap_schedule_rule if rule.__name__ in DEFERRED_RULES else rule)(cfg, world)
        except ConfigError as e:
            return i, str(e)
    return None


def enumerate_layouts(base: Config, world: int, global_batch_size: int, seq_length: int,
                      precision: str) -> tuple[list[Layout], dict[str, tuple[int, int]]]:
    """(accepted layouts, {rule's first 160 characters: (rules passed before it, candidates refused)}).

    ``base`` supplies the model and everything the planner does not choose.
    """
    scratch = copy.deepcopy(base)
    layouts, refused = [], {}
    for tp, cp, pp, dp, ep in _axes(base, world):
        choices = itertools.product(divisors(max(base.model.num_layers // pp, 1)), ZERO_LEVELS, SCHEDULES.names(),
                                    (False, True) if tp > 1 else (False,),
                                    CONTEXT_ALGORITHMS if cp > 1 else ("ring",),
                                    divisors(max(global_batch_size // dp, 1)), RECOMPUTE)
        for vpp, zero, schedule, sp, algo, mbs, rc in choices:
            lay = Layout(tp, pp, vpp, dp, cp, ep, zero, schedule, mbs, rc, sp, algo)
            why = accepted(apply(scratch, lay, global_batch_size, seq_length, precision), world)
            if why is None:
                layouts.append(lay)
            else:
                stage, rule = why
                refused[rule[:160]] = (stage, refused.get(rule[:160], (stage, 0))[1] + 1)
    return layouts, refused
