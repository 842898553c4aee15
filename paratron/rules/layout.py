"""Rules of the layout that ask the packages owning it: the rank grid
(:func:`paratron.parallel.grid.check_grid`), the pipeline split
(:func:`paratron.pipeline.partition.stage_sizes`) and the registered schedules
(:mod:`paratron.pipeline.registry`), plus the chunk count a schedule implies.

Each rule takes ``(cfg, world_size_or_None)`` and raises :class:`ConfigError` naming the fields.
"""

from __future__ import annotations

from paratron.config.sections import Config
from paratron.config.token_rules import token_balanced
from paratron.config.validators import data_parallel_size
from paratron.errors import ConfigError
from paratron.parallel.grid import LayoutError, check_grid
from paratron.pipeline.partition import stage_sizes
from paratron.pipeline.registry import SCHEDULES, build_schedule, config_options, get_schedule


def imply_schedule_defaults(cfg: Config, given: set[str]) -> None:
    """A schedule that always runs a fixed number of chunks per rank (zbv: 2) sets
    ``parallel.virtual_pipeline`` to it unless that field was given (``given``: the dotted keys
    set by the file or the overrides); a different given value is refused by validation."""
    if "parallel.virtual_pipeline" in given or cfg.parallel.schedule not in SCHEDULES:
        return
    fixed = SCHEDULES.get(cfg.parallel.schedule).virtual_stages
    if fixed is not None:
        cfg.parallel.virtual_pipeline = fixed


def _grid(cfg: Config, world: int | None) -> None:
    if world is None:
        return
    p = cfg.parallel
    try:  # the grid's rules without its groups: constant time on thousands of ranks
        check_grid(world, tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline, expert_tp=p.expert_tensor,
                   order=p.order)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def _pipeline_layers(cfg: Config, world: int | None) -> None:
    p = cfg.parallel
    try:
        stage_sizes(cfg.model.num_layers, p.pipeline, p.virtual_pipeline, p.pipeline_layout)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _unused_schedule_options(p, spec) -> None:
    """Link costs set for a schedule that takes none would be silently ignored: refuse them."""
    given = [f"parallel.{f}" for f in ("pipeline_link_latency_ms", "pipeline_microbatch_time_ms")
             if getattr(p, f) is not None]
    if given and spec.options is None:
        raise ConfigError(f"{' and '.join(given)} only shape schedules that take link costs "
                          f"(1f1b-delay); parallel.schedule={p.schedule!r} would ignore them: "
                          "unset them or choose such a schedule")


def check_schedule(cfg: Config, world: int | None, *, build: bool = True) -> None:
    """The pipeline schedule rule: the name is registered, the schedule's fixed chunk count (zbv: 2)
    matches ``parallel.virtual_pipeline``, and (with a world size) the schedule accepts this
    (p, microbatches, v), checked by building and validating its action lists (``build=True``), or
    only by the schedule's own ``check`` (``build=False``: fast, for a search over layouts).

    Raises:
        ConfigError: naming the fields, the microbatch count and the schedule's rule.
    """
    p, t = cfg.parallel, cfg.train
    spec = get_schedule(p.schedule)  # ConfigError with did-you-mean for an unknown name
    if spec.virtual_stages is not None and p.virtual_pipeline != spec.virtual_stages:
        raise ConfigError(f"parallel.schedule={p.schedule!r} always runs {spec.virtual_stages} chunks per rank, "
                          f"but parallel.virtual_pipeline={p.virtual_pipeline} was given: leave it unset "
                          f"or set parallel.virtual_pipeline={spec.virtual_stages}")
    _unused_schedule_options(p, spec)
    dp = data_parallel_size(cfg, world)
    if token_balanced(cfg):
        return  # the microbatch count varies per step: rules.tokens checks the schedule for every count
    if dp is None or t.global_batch_size % (t.micro_batch_size * dp):
        return  # the microbatch count is not known yet
    m = t.global_batch_size // (t.micro_batch_size * dp)
    try:
        if build:
            options = config_options(p.schedule, p) or {}  # 1f1b-delay: the configured link costs
            build_schedule(p.schedule, p.pipeline, m, p.virtual_pipeline, **options)
        else:
            spec.accepts(p.pipeline, m, p.virtual_pipeline)
    except ValueError as e:
        raise ConfigError(
            f"parallel.schedule={p.schedule!r} with parallel.pipeline={p.pipeline}, "
            f"parallel.virtual_pipeline={p.virtual_pipeline} and {m} microbatches per step "
            f"(train.global_batch_size / (train.micro_batch_size * dp) = {t.global_batch_size} / "
            f"({t.micro_batch_size} * {dp})): {e}") from None


def _schedule(cfg: Config, world: int | None) -> None:
    check_schedule(cfg, world, build=True)
