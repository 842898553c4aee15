"""Schedules by name: ``parallel.schedule=NAME`` selects one (docs/DESIGN.md principle 7).

A schedule is a function ``(p, m, v) -> list[list[Action]]`` with a placement (which stages each
rank holds) and an optional ``check(p, m, v)`` that raises ``ValueError`` with the rule when a
combination is unsupported. :func:`build_schedule` runs the check first, then the function, then
verifies that the lists use the declared placement, so an unsupported combination fails when the
schedule is built and never as a hang.

:data:`SCHEDULES` (a :class:`paratron.registry.Registry`) holds the built-ins;
:func:`register_schedule` adds to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from paratron.registry import Registry

from . import delay, dualpipev, schedules
from .actions import Action, stages_of
from .placement import Placement, loop_placement, v_placement
from .validate import validate

ScheduleFn = Callable[[int, int, int], list[list[Action]]]


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered schedule.

    Attributes:
        name: registry key.
        fn: ``(p, m, v) -> list[list[Action]]``, one list per pipeline rank.
        placement: ``(p, v) -> stages per rank`` (:mod:`.placement`).
        check: ``(p, m, v) -> None``, raising ``ValueError`` with the rule for unsupported input.
        virtual_stages: the chunks per rank the schedule always uses (zbv: 2), which
            ``parallel.virtual_pipeline`` then defaults to; None when that field chooses.
        options: ``(parallel_cfg, measured_microbatch_time) -> dict | None``: the keywords the
            training step gives ``fn`` from the config (``1f1b-delay``: its link costs), None
            while a measured microbatch time is still needed (:func:`config_options`).
    """

    name: str
    fn: ScheduleFn
    placement: Placement = loop_placement
    check: Callable[[int, int, int], None] | None = None
    virtual_stages: int | None = None
    options: Callable[[Any, float | None], dict | None] | None = None

    def accepts(self, p: int, m: int, v: int) -> None:
        """The one check of ``(p, m, v)``: positive integers, then the schedule's own ``check``.

        Raises:
            ValueError: the rule broken, naming the schedule.
        """
        for field, value in (("pipeline size p", p), ("microbatches m", m), ("virtual stages v", v)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"schedule {self.name!r}: {field}={value!r} must be a positive integer")
        if self.check is not None:
            self.check(p, m, v)


def _make_spec(name: str, fn: ScheduleFn, *, placement: Placement = loop_placement,
               check: Callable[[int, int, int], None] | None = None,
               virtual_stages: int | None = None, options=None) -> ScheduleSpec:
    return ScheduleSpec(name, fn, placement, check, virtual_stages, options)


SCHEDULES: Registry[ScheduleSpec] = Registry("schedule", "parallel.schedule", make=_make_spec)
"""``SCHEDULES.register(name, fn, placement=, check=, replace=)`` adds a schedule."""
SCHEDULES.register("gpipe", schedules.gpipe, check=schedules.check_gpipe)
SCHEDULES.register("1f1b", schedules.one_f_one_b, check=schedules.check_1f1b)
SCHEDULES.register("interleaved", schedules.interleaved, check=schedules.check_interleaved)
SCHEDULES.register("zb-h1", schedules.zb_h1, check=schedules.check_zb_h1)
SCHEDULES.register("zbv", schedules.zbv, placement=v_placement, check=schedules.check_zbv, virtual_stages=2)
SCHEDULES.register("dualpipev", dualpipev.dualpipev, placement=v_placement, check=dualpipev.check_dualpipev,
                   virtual_stages=2)
SCHEDULES.register("1f1b-delay", delay.one_f_one_b_delay, check=schedules.check_1f1b, options=delay.config_options)


def register_schedule(name: str, fn: ScheduleFn, **kwargs) -> ScheduleSpec:
    """Register ``fn`` under ``name`` in :data:`SCHEDULES` (keywords ``placement``, ``check``,
    ``virtual_stages``, ``options``, ``replace``; see :class:`ScheduleSpec`)."""
    return SCHEDULES.register(name, fn, **kwargs)


def get_schedule(name: str) -> ScheduleSpec:
    """The spec registered under ``name``.

    Raises:
        ConfigError: unknown name, with did-you-mean and the known names.
    """
    return SCHEDULES.get(name)


def config_options(name: str, parallel_cfg, measured_microbatch_time: float | None = None) -> dict | None:
    """The keywords ``build_schedule(name, ...)`` gets from the ``parallel`` config section (and a
    measured microbatch time, in seconds): ``{}`` for a schedule that takes none; None when the
    schedule needs a microbatch time that is neither configured nor measured yet (build with
    ``{}`` meanwhile)."""
    spec = get_schedule(name)
    return {} if spec.options is None else spec.options(parallel_cfg, measured_microbatch_time)


def default_microbatches(p: int) -> int:
    """A microbatch count that every built-in schedule accepts for any ``v``: ``2p``."""
    return 2 * p


def build_schedule(name: str, p: int, m: int, v: int = 1, *, check: bool = True,
                   **options) -> list[list[Action]]:
    """Build the action lists of schedule ``name`` for ``p`` ranks, ``m`` microbatches and ``v``
    virtual stages per rank (``options`` go to schedules that take keywords, e.g. ``1f1b-delay``'s
    link costs), and (``check=True``) prove them with
    :func:`~paratron.pipeline.validate.validate`, so that a faulty custom schedule fails here
    instead of hanging the runtime (about a millisecond for p=8, m=16).

    Raises:
        ConfigError: unknown name.
        ValueError: an unsupported (p, m, v) (the schedule's rule is in the message);
            lists whose count or stages differ from the schedule's placement; or
            :class:`~paratron.pipeline.validate.ScheduleError` from the validator.
    """
    spec = get_schedule(name)
    spec.accepts(p, m, v)
    lists = spec.fn(p, m, v, **options)
    expected = spec.placement(p, v)
    if len(lists) != p:
        raise ValueError(f"schedule {name!r} returned {len(lists)} action lists for pipeline size p={p}")
    for r, acts in enumerate(lists):
        if stages_of(acts) != expected[r]:
            raise ValueError(f"schedule {name!r}: rank {r} runs stages {stages_of(acts)}, but its placement "
                             f"gives it {expected[r]}")
    if check:
        validate(lists, m)
    return lists
