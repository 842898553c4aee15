"""Each validator rule's verdict, remembered by the values of the layout fields the rule read.

The planner runs every rule of :data:`paratron.rules.VALIDATORS` on each candidate layout (about
two million candidates at 1,536 ranks), yet most rules read one to four of the fields a layout
sets (the grid rule: the axis sizes; the batch rule: the microbatch size and dp) and give the
same verdict for every candidate that agrees on them. :class:`VerdictMemo` runs a rule once per
distinct value of what it read and answers the rest from a table.

It is exact, not a heuristic. A rule is a deterministic function of the config it reads (and the
world size and registries, fixed during a search). While a rule runs on the scratch config, the
sections the layout writes to are given a class that records every field read (``vars()`` and
any other dunder access count as reading the whole section) and refuses to cache a rule that
writes a field. A later candidate agreeing with a recorded run on every field that run read
makes the rule take the same path, so it gets the same verdict (a rule whose reads differ with
the values, e.g. ``context_algorithm`` read only when ``context > 1``, gets one table per set of
fields read). ``tests/test_planner_search.py`` checks the accepted layouts and refusal counts
equal those of running every rule on every candidate.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

from paratron.config import Config, ConfigError

SAFE_DUNDERS = frozenset({"__class__", "__dataclass_fields__", "__dataclass_params__"})
"""Dunder attributes that read no field (class-level metadata ``isinstance``/``dataclasses`` ask for)."""

_MISS = object()
_NONE: dict = {}
Rule = Callable[[Config, "int | None"], None]


class VerdictMemo:
    """The first rule of ``rules`` refusing a scratch config whose ``written`` fields change between calls.

    Args:
        scratch: the one config object every candidate is applied to before its rules run.
        written: ``{section name: field names}`` a layout writes (everything else of ``scratch``
            stays as it is for the memo's lifetime).
        rules: ``(index, rule)`` in the order they run; the index is returned with the message.
    """

    def __init__(self, scratch: Config, written: dict[str, tuple[str, ...]], rules: list[tuple[int, Rule]]):
        self.scratch, self.written, self.rules, self.every_rule = scratch, written, list(rules), list(rules)
        self.sections = {name: getattr(scratch, name) for name in written}
        self.tables: dict[Rule, dict[tuple, tuple[Callable | None, dict]]] = {}  # fields read: (their key, verdicts)
        self.broken = False  # a rule wrote the config: from then on every rule runs every time
        self.runs = 0
        self._reads: set[tuple[str, str]] | None = None
        self._wrote = False
        self._tracking = {name: self._tracking_class(name, type(sec)) for name, sec in self.sections.items()}

    def refusal(self, world: int | None) -> tuple[int, str] | None:
        """None if every rule accepts the scratch config on ``world`` ranks, else (the first
        refusing rule's index, its message).

        Raises:
            Whatever but :class:`ConfigError` a rule raises (not remembered).
        """
        cfg = self.scratch
        if self.broken:
            return _first_refusal(self.every_rule, cfg, world)
        rules = self.rules
        for j, (i, rule) in enumerate(rules):
            message = _MISS
            for key, table in self.tables.get(rule, _NONE).values():
                message = table.get(key(cfg) if key else (), _MISS)
                if message is not _MISS:
                    break
            if message is _MISS:
                message = self._learn(rule, world)
                if self.broken and message is None:  # the rules after it see what it wrote
                    return _first_refusal(rules[j + 1:], cfg, world)
            if message is not None:
                return i, message
        return None

    def _learn(self, rule: Rule, world: int | None) -> str | None:
        """Run ``rule`` tracking its reads; remember its verdict under them (a rule that read no
        field written passes or fails every candidate alike: one that passes is dropped)."""
        self.runs += 1
        reads, message = self._run(rule, world)
        if reads is None:
            return message
        names = tuple(f"{s}.{f}" for s, f in sorted(reads))
        if not names and message is None:
            self.rules = [(i, r) for i, r in self.rules if r is not rule]
        key, table = self.tables.setdefault(rule, {}).setdefault(
            names, (operator.attrgetter(*names) if names else None, {}))
        table[key(self.scratch) if key else ()] = message
        return message

    def _run(self, rule: Rule, world: int | None) -> tuple[set | None, str | None]:
        """(fields read, or None when the rule may not be remembered; its message or None)."""
        self._reads, self._wrote = set(), False
        plain = {name: type(sec) for name, sec in self.sections.items()}
        for name, sec in self.sections.items():
            object.__setattr__(sec, "__class__", self._tracking[name])
        try:
            message = _message(rule, self.scratch, world)
        finally:
            for name, sec in self.sections.items():
                object.__setattr__(sec, "__class__", plain[name])
            reads, self._reads = self._reads, None
        self.broken = self.broken or self._wrote
        return (None if self.broken else reads), message

    def _tracking_class(self, section: str, cls: type) -> type:
        """A subclass of ``cls`` (same fields, same methods) recording reads of written fields."""
        memo, fields = self, frozenset(self.written[section])

        def __getattribute__(obj, name):
            reads = memo._reads
            if reads is not None:
                if name in fields:
                    reads.add((section, name))
                elif name.startswith("__") and name not in SAFE_DUNDERS:
                    reads.update((section, f) for f in fields)
            return cls.__getattribute__(obj, name)

        def __setattr__(obj, name, value):
            memo._wrote = True
            cls.__setattr__(obj, name, value)

        return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__setattr__": __setattr__,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _first_refusal(rules: list[tuple[int, Rule]], cfg: Config, world: int | None) -> tuple[int, str] | None:
    for i, rule in rules:
        message = _message(rule, cfg, world)
        if message is not None:
            return i, message
    return None


def _message(rule: Rule, cfg: Config, world: int | None) -> str | None:
    try:
        rule(cfg, world)
    except ConfigError as e:
        return str(e)
    return None


def fields_written(cfg: Config, write: Callable[[Config], object]) -> dict[str, tuple[str, ...]]:
    """``{section: fields}`` that ``write(cfg)`` assigns (run on ``cfg``; ``write`` must assign the
    same fields whatever the values, as :func:`paratron.planner.layout.apply` does)."""
    names = [f.name for f in dataclasses.fields(cfg)]
    seen: dict[str, list[str]] = {}
    plain = {name: type(getattr(cfg, name)) for name in names}

    def recorder(section: str, cls: type) -> type:
        def __setattr__(obj, name, value):
            seen.setdefault(section, []).append(name)
            cls.__setattr__(obj, name, value)
        return type(cls.__name__, (cls,), {"__setattr__": __setattr__})

    for name in names:
        object.__setattr__(getattr(cfg, name), "__class__", recorder(name, plain[name]))
    try:
        write(cfg)
    finally:
        for name in names:
            object.__setattr__(getattr(cfg, name), "__class__", plain[name])
    return {section: tuple(dict.fromkeys(f)) for section, f in seen.items()}
