"""Config rules of token-balanced variable-length microbatches (``data.microbatch_tokens``,
:mod:`paratron.data.token_batches`), run by :func:`paratron.config.validators.validate` before
any process group exists. Each raises :class:`ConfigError` naming the fields and the rule."""

from __future__ import annotations

from .errors import ConfigError
from .sections import Config


def token_balanced(cfg: Config) -> bool:
    """Whether the run forms token-balanced microbatches (the one test of the mode)."""
    return cfg.data.microbatch_tokens is not None


def _budget(cfg: Config) -> None:
    n, s = cfg.data.microbatch_tokens, cfg.model.seq_length
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"data.microbatch_tokens={n!r} must be a positive integer (positions per microbatch)")
    if n < s:
        raise ConfigError(f"data.microbatch_tokens={n} is below model.seq_length={s}: documents longer than "
                          "seq_length positions are split into pieces of seq_length, and every piece must fit "
                          f"one microbatch; set data.microbatch_tokens >= {s} or lower model.seq_length")


def _incompatible(cfg: Config) -> None:
    p, m, d = cfg.parallel, cfg.model, cfg.data
    name = f"data.microbatch_tokens={d.microbatch_tokens}"
    if m.attention_dropout > 0:
        raise ConfigError(f"{name} with model.attention_dropout={m.attention_dropout}: packed documents use "
                          "per-document attention, which has no attention dropout; set it to 0")
    if m.num_experts and m.moe_capacity_factor is not None:
        raise ConfigError(f"{name} with model.moe_capacity_factor={m.moe_capacity_factor}: which tokens are "
                          "dropped would depend on how documents are grouped (which depends on the DP size); "
                          "leave it unset (dropless)")
    if m.num_experts and (m.moe_aux_loss_coeff > 0 or m.moe_z_loss_coeff > 0):
        raise ConfigError(f"{name} with model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} / moe_z_loss_coeff="
                          f"{m.moe_z_loss_coeff}: the router losses are means over each microbatch (or count "
                          "its padding segment), which would depend on how documents are grouped and padded, "
                          "i.e. on the DP/TP/CP layout; set both to 0 (model.moe_router_enable_expert_bias "
                          "balances without a loss)")
    prefixes = [x for x in d.data_path if not _is_number(x)]
    if len(prefixes) > 1:
        raise ConfigError(f"{name} with {len(prefixes)} data.data_path prefixes: token-balanced microbatches read "
                          "whole documents of one dataset; merge them (paratron preprocess) or use one prefix")


def row_multiple(p) -> int:
    """Positions a token-balanced row is padded to a multiple of: the context-parallel split
    (ring: 2C chunks, all2all: C) times TP under sequence parallelism (the rules of
    :mod:`.context_rules` and ``_sequence`` for ``seq_length``, applied to each row)."""
    split = 2 * p.context if p.context > 1 and p.context_algorithm == "ring" else p.context
    return split * (p.tensor if p.sequence_parallel else 1)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _schedule(cfg: Config, world: int | None) -> None:
    """The microbatch count changes from step to step, so the schedule must take any count (from
    1 to ``2 * p * v``, checked); the global batch must give every DP rank a microbatch."""
    from paratron.pipeline.registry import get_schedule

    p, t = cfg.parallel, cfg.train
    spec = get_schedule(p.schedule)
    for m in range(1, 2 * p.pipeline * p.virtual_pipeline + 1):
        try:
            if spec.check is not None:
                spec.check(p.pipeline, m, p.virtual_pipeline)
        except ValueError as e:
            raise ConfigError(f"data.microbatch_tokens={cfg.data.microbatch_tokens} gives a microbatch count that "
                              f"varies per step, but parallel.schedule={p.schedule!r} (parallel.pipeline="
                              f"{p.pipeline}, parallel.virtual_pipeline={p.virtual_pipeline}) refuses {m} "
                              f"microbatches: {e}") from None
    mp = p.tensor * p.context * p.pipeline
    if world is not None and world % mp == 0 and t.global_batch_size < world // mp:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} documents is below the data-parallel "
                          f"size {world // mp}: every DP rank needs at least one document per step")


def check_microbatch_tokens(cfg: Config, world: int | None) -> None:
    """``data.microbatch_tokens``: a positive integer ``>= model.seq_length``; not with attention
    dropout, MoE capacity dropping, MoE aux/z losses or a blend of prefixes; a schedule that
    takes any microbatch count; at least one document per DP rank.

    Raises:
        ConfigError: the first rule broken.
    """
    if not token_balanced(cfg):
        return
    _budget(cfg)
    _incompatible(cfg)
    _schedule(cfg, world)
