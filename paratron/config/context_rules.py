"""Config rules of context parallelism and packed documents, run by
:func:`paratron.rules.validate` before any process group exists.

Each rule raises :class:`ConfigError` naming the fields, their values and the rule.
"""

from __future__ import annotations

from .errors import ConfigError
from .model_shape import query_groups
from .sections import Config


def _split(cfg: Config) -> None:
    p, s = cfg.parallel, cfg.model.seq_length
    c = p.context
    if p.context_algorithm not in ("ring", "all2all"):
        raise ConfigError(f"parallel.context_algorithm={p.context_algorithm!r} must be 'ring' or 'all2all'")
    if c > 1 and p.context_algorithm == "ring" and s % (2 * c):
        raise ConfigError(f"model.seq_length={s} is not divisible by 2*parallel.context={2 * c}: the ring "
                          "splits each sequence into 2C chunks (rank i holds chunks i and 2C-1-i)")
    if c > 1 and p.context_algorithm == "all2all" and s % c:
        raise ConfigError(f"model.seq_length={s} is not divisible by parallel.context={c}: all2all "
                          "splits each sequence into C chunks")
    if c > 1 and p.sequence_parallel and (s // c) % p.tensor:
        raise ConfigError(f"model.seq_length/parallel.context = {s}/{c} = {s // c} tokens per CP rank is not "
                          f"divisible by parallel.tensor={p.tensor}, which sequence parallelism needs")


def _heads(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    if p.context > 1 and p.context_algorithm == "all2all":
        groups = query_groups(m)
        if groups % (p.context * p.tensor):
            raise ConfigError(
                f"model.num_query_groups={groups} is not divisible by parallel.context*parallel.tensor = "
                f"{p.context}*{p.tensor}: parallel.context_algorithm='all2all' gives every CP rank whole "
                "query groups of its TP rank's heads (use 'ring', or fewer ranks)")


def _unsupported(cfg: Config) -> None:
    p, m, d = cfg.parallel, cfg.model, cfg.data
    custom = p.context > 1 or d.reset_attention_mask
    if custom and m.attention_dropout > 0:
        raise ConfigError(f"model.attention_dropout={m.attention_dropout} is not supported with "
                          f"parallel.context={p.context} > 1 or data.reset_attention_mask=true; set it to 0")
    if p.context > 1 and m.num_experts and m.moe_capacity_factor is not None:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} with parallel.context={p.context}: "
                          "capacity dropping would depend on the CP split; leave it unset (dropless)")


def check_context(cfg: Config, world: int | None) -> None:
    """Context parallelism (``parallel.context``, ``parallel.context_algorithm``) and packed
    documents (``data.reset_attention_mask``) fit the model.

    Raises:
        ConfigError: ring with ``seq_length % 2C``, all2all with ``seq_length % C`` or query groups
            not divisible by ``C * TP``, SP with ``(seq_length / C) % TP``, attention dropout with
            CP or document masking, capacity dropping with CP.
    """
    _split(cfg)
    _heads(cfg)
    _unsupported(cfg)
