"""Config rules of token-balanced variable-length microbatches (``data.microbatch_tokens``,
:mod:`paratron.data.token_batches`), run by :func:`paratron.rules.validate` before any process
group exists. Each raises :class:`ConfigError` naming the fields and the rule."""

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
    m, d = cfg.model, cfg.data
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


def row_multiple(p) -> int:
    """Positions a token-balanced row is padded to a multiple of: the context-parallel split
    (ring: 2C chunks, all2all: C) times TP under sequence parallelism (the rules of
    :mod:`.context_rules` and ``_sequence`` for ``seq_length``, applied to each row)."""
    split = 2 * p.context if p.context > 1 and p.context_algorithm == "ring" else p.context
    return split * (p.tensor if p.sequence_parallel else 1)


def check_microbatch_tokens(cfg: Config, world: int | None) -> None:
    """``data.microbatch_tokens``: a positive integer ``>= model.seq_length``; not with attention
    dropout, MoE capacity dropping or MoE aux/z losses. The rules that ask other packages (one
    data prefix, a schedule that takes any microbatch count, a document per DP rank) are
    :func:`paratron.rules.tokens.check_token_layout`.

    Raises:
        ConfigError: the first rule broken.
    """
    if not token_balanced(cfg):
        return
    _budget(cfg)
    _incompatible(cfg)
