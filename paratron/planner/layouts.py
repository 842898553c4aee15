"""Every layout the config validator accepts, for a model, world size and global batch.

The planner has no rules of its own: it proposes each combination of axis sizes (divisors of the
world size), ZeRO level, registered schedule, virtual stages, microbatch size, recompute mode,
sequence parallelism and context-parallel algorithm, and keeps those that the rules of
:data:`paratron.rules.VALIDATORS` accept. So a ZeRO level or a context-parallel size becomes
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

from paratron.config import Config, ConfigError
from paratron.optim.zero import ZERO_LEVELS
from paratron.pipeline.registry import SCHEDULES
from paratron.progress import progress_bar
from paratron.rules import VALIDATORS, check_schedule

from .layout import Layout, apply
from .verdicts import VerdictMemo, fields_written

RECOMPUTE = ("none", "selective", "full")
CONTEXT_ALGORITHMS = ("ring", "all2all")
CHOICE_FIELDS = ("parallel.virtual_pipeline", "parallel.schedule", "virtual stages", "parallel.zero",
                 "parallel.sequence_parallel", "parallel.context_algorithm", "train.micro_batch_size",
                 "model.recompute")
"""The choices below the axis sizes, as rule messages name them (the last five: below the schedule)."""
DEFERRED_RULES = ("_schedule",)
"""Validator rules run lazily by the search (they build the schedule's lists)."""
LAYOUT_FREE_RULES = ("_finite",)
"""Validator rules no layout can change the verdict of, once the base config passes them: they
read only float fields, and :func:`.layout.apply` writes ints, bools and strings. Run once on the
base config instead of on each layout (in a profile of the search at 1,536 ranks ``_finite``
took half of the enumeration's time); when the base fails one, every layout runs every rule as before."""


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


def _rules(skip: tuple[str, ...] = ()) -> list[tuple[int, object]]:
    """(index in :data:`VALIDATORS`, rule as enumeration runs it) but those named in ``skip``."""
    return [(i, _cheap_schedule_rule if rule.__name__ in DEFERRED_RULES else rule)
            for i, rule in enumerate(VALIDATORS) if rule.__name__ not in skip]


def accepted(cfg: Config, world: int, skip: tuple[str, ...] = ()) -> tuple[int, str] | None:
    """None when the validator's rules (the deferred one by its fast part) accept ``cfg`` on
    ``world`` ranks, else (how many rules it passed first, the rule broken); the rules named in
    ``skip`` are known to pass (:data:`LAYOUT_FREE_RULES`)."""
    for i, rule in _rules(skip):
        try:
            rule(cfg, world)
        except ConfigError as e:
            return i, str(e)
    return None


def _passed_once(base: Config, world: int) -> tuple[str, ...]:
    """The :data:`LAYOUT_FREE_RULES` that ``base`` passes (each layout would pass them too)."""
    passed = []
    for rule in VALIDATORS:
        if rule.__name__ in LAYOUT_FREE_RULES:
            try:
                rule(base, world)
                passed.append(rule.__name__)
            except ConfigError:
                pass
    return tuple(passed)


def enumerate_layouts(base: Config, world: int, global_batch_size: int, seq_length: int, precision: str,
                      quiet: bool = True, remember: bool = True) -> tuple[list[Layout], dict[str, tuple[int, int]]]:
    """(accepted layouts, {rule's first 160 characters: (rules passed before it, candidates refused)}).

    ``base`` supplies the model and everything the planner does not choose. Choices are made level
    by level (axis sizes; chunks and schedule; the rest); a level's candidate is first tried with
    the simplest remaining choices, and dropped with all of them when the rule it breaks names
    none of the remaining fields (every rule message names its fields), which keeps the search
    fast on thousands of ranks without a rule of the planner's own. Each rule's verdict is
    remembered by the layout fields it read (:class:`.verdicts.VerdictMemo`; ``remember=False``
    runs every rule on every candidate: the same result, ~10 times slower at 1,536 ranks), and a
    candidate checked at an upper level is not checked again. Unless ``quiet``, a progress bar
    counts the axis sizes tried.
    """
    scratch = copy.deepcopy(base)
    layouts, refused = [], {}
    skip = _passed_once(base, world)
    memo = VerdictMemo(scratch, fields_written(scratch, lambda c: apply(
        c, Layout(1, 1, 1, world, 1, 1, 0, "1f1b", 1, "none", False), global_batch_size, seq_length,
        precision)), _rules(skip)) if remember else None
    seen: dict[Layout, tuple[int, str] | None] = {}  # the upper levels' candidates, met again below

    def check(lay: Layout, later: tuple[str, ...]) -> bool:
        if lay in seen:
            why = seen[lay]
        else:
            apply(scratch, lay, global_batch_size, seq_length, precision)
            why = memo.refusal(world) if memo else accepted(scratch, world, skip)
        if later:
            seen[lay] = why
        if why is None:
            return True
        if not later or not any(f in why[1] for f in later):
            refused[why[1][:160]] = (why[0], refused.get(why[1][:160], (why[0], 0))[1] + 1)
            return False
        return True

    axes = list(_axes(base, world))
    for tp, cp, pp, dp, ep in progress_bar(desc="plan: enumerate", iterable=axes, quiet=quiet, unit="axes"):
        if not check(Layout(tp, pp, 1, dp, cp, ep, 0, "1f1b", 1, "none", False), CHOICE_FIELDS):
            continue
        for vpp, schedule in itertools.product(divisors(max(base.model.num_layers // pp, 1)), SCHEDULES.names()):
            if not check(Layout(tp, pp, vpp, dp, cp, ep, 0, schedule, 1, "none", False), CHOICE_FIELDS[3:]):
                continue
            rest = itertools.product(ZERO_LEVELS, (False, True) if tp > 1 else (False,),
                                     CONTEXT_ALGORITHMS if cp > 1 else ("ring",),
                                     divisors(max(global_batch_size // dp, 1)), RECOMPUTE)
            for zero, sp, algo, mbs, rc in rest:
                lay = Layout(tp, pp, vpp, dp, cp, ep, zero, schedule, mbs, rc, sp, algo)
                if check(lay, ()):
                    layouts.append(lay)
    return layouts, refused
