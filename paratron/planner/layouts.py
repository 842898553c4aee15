"""Every layout the config validator accepts, for a model, world size and global batch.

The planner has no rules of its own: it proposes each combination of axis sizes (divisors of the
world size), ZeRO level, registered schedule, virtual stages, microbatch size, recompute mode and
sequence parallelism, and keeps those that :func:`paratron.config.validate` and the schedule's own
check (the pre-flight of ``paratron train``) accept. So a ZeRO level or a context-parallel size
becomes plannable the day the validator starts accepting it.
"""

from __future__ import annotations

import copy
import itertools
from typing import Iterator

from paratron.config import VALIDATORS, Config, ConfigError
from paratron.pipeline.registry import SCHEDULES, get_schedule

from .layout import Layout, apply

ZERO_LEVELS = (0, 1, 2, 3)
RECOMPUTE = ("none", "selective", "full")


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


def accepted(cfg: Config, world: int) -> tuple[int, str] | None:
    """None when ``paratron train`` would accept ``cfg`` on ``world`` ranks, else (how many rules it
    passed first, the rule broken): the later the rule, the closer the candidate came."""
    for i, rule in enumerate(VALIDATORS):
        try:
            rule(cfg, world)
        except ConfigError as e:
            return i, str(e)
    p, t = cfg.parallel, cfg.train
    m = t.global_batch_size // (t.micro_batch_size * world // (p.tensor * p.context * p.pipeline))
    check = get_schedule(p.schedule).check
    try:
        if check is not None:
            check(p.pipeline, m, p.virtual_pipeline)
    except ValueError as e:
        return len(VALIDATORS), f"parallel.schedule={p.schedule!r}: {e}"
    return None


def enumerate_layouts(base: Config, world: int, global_batch_size: int, seq_length: int,
                      precision: str) -> tuple[list[Layout], dict[str, int]]:
    """(accepted layouts, {rule's first 80 characters: (rules passed before it, candidates refused)}).

    ``base`` supplies the model and everything the planner does not choose.
    """
    scratch = copy.deepcopy(base)
    layouts, refused = [], {}
    for tp, cp, pp, dp, ep in _axes(base, world):
        choices = itertools.product(divisors(max(base.model.num_layers // pp, 1)), ZERO_LEVELS, SCHEDULES.names(),
                                    (False, True) if tp > 1 else (False,),
                                    divisors(max(global_batch_size // dp, 1)), RECOMPUTE)
        for vpp, zero, schedule, sp, mbs, rc in choices:
            lay = Layout(tp, pp, vpp, dp, cp, ep, zero, schedule, mbs, rc, sp)
            why = accepted(apply(scratch, lay, global_batch_size, seq_length, precision), world)
            if why is None:
                layouts.append(lay)
            else:
                stage, rule = why
                refused[rule[:80]] = (stage, refused.get(rule[:80], (stage, 0))[1] + 1)
    return layouts, refused
