"""Rules of the low-rank (CoLA) projections and their two tensor-parallel plans (docs/boost.md).

``model.low_rank = r`` replaces every attention and MLP linear by ``B silu(A x)`` (Liu et al.
2025, "CoLA: Compute-Efficient Pre-Training of LLMs via Low-Rank Activation");
``model.low_rank_tp`` chooses how TP splits the factors ("naive" or BOOST's "bottleneck",
MLSys'26). The rules are checked by config validation and again by the layers' constructors,
before any collective.
"""

from __future__ import annotations

from .errors import ConfigError
from .sections import Config, ModelConfig

LOW_RANK_PLANS = ("naive", "bottleneck")


def _unsupported(m: ModelConfig, context: int, fp8) -> list[str]:
    """The settings the low-rank layers do not implement, as ``field=value`` strings."""
    bad = []
    if m.add_bias_linear or m.add_qkv_bias:
        bad.append(f"model.add_bias_linear={m.add_bias_linear} / add_qkv_bias={m.add_qkv_bias} "
                   "(the factorised projections have no bias: set both false)")
    for name, off in (("num_experts", 0), ("multi_latent_attention", False), ("qk_layernorm", False),
                      ("mtp_num_layers", 0), ("hidden_dropout", 0.0), ("attention_dropout", 0.0),
                      ("lora_rank", 0)):
        if getattr(m, name) != off:
            bad.append(f"model.{name}={getattr(m, name)!r} (needs {off!r})")
    if m.recompute == "selective":
        bad.append("model.recompute='selective' (its attention-core recompute is SelfAttention's; use "
                   "model.low_rank_recompute with the bottleneck plan, or recompute='full')")
    if context != 1:
        bad.append(f"parallel.context={context} (needs 1)")
    if fp8 is not None:
        bad.append(f"train.fp8={fp8!r} (needs none)")
    return bad


def check_low_rank_model(m: ModelConfig, tp: int, sequence_parallel: bool = False, context: int = 1,
                         fp8=None) -> None:
    """Check ``model.low_rank``, ``low_rank_tp`` and ``low_rank_recompute`` against TP size ``tp``.

    Raises:
        ConfigError: naming the field and the rule: a negative rank, or one above ``hidden_size``
            (no compression); an unknown plan; ``naive`` with ``r`` not divisible by ``tp`` (A is
            split by its r rows); ``bottleneck`` with ``hidden_size`` not divisible by ``tp`` (the
            residual stream is split along it), with sequence parallelism (the stream is already
            split along h), or with a norm other than RMSNorm (the online norm needs one sum per
            token); ``low_rank_recompute`` without ``low_rank > 0`` and ``bottleneck``; any
            setting in :func:`_unsupported`.
    """
    r = m.low_rank
    if r < 0:
        raise ConfigError(f"model.low_rank={r} must be >= 0 (0: full-rank projections)")
    if m.low_rank_tp not in LOW_RANK_PLANS:
        raise ConfigError(f"model.low_rank_tp={m.low_rank_tp!r} must be one of {LOW_RANK_PLANS}")
    if m.low_rank_recompute and (r == 0 or m.low_rank_tp != "bottleneck"):
        raise ConfigError(f"model.low_rank_recompute=true needs model.low_rank > 0 (is {r}) and "
                          f"model.low_rank_tp='bottleneck' (is {m.low_rank_tp!r})")
    if r == 0:
        return
    if r > m.hidden_size:
        raise ConfigError(f"model.low_rank={r} must be <= model.hidden_size={m.hidden_size} (a rank above h "
                          "is no compression)")
    bad = _unsupported(m, context, fp8)
    if bad:
        raise ConfigError(f"model.low_rank={r} does not support: " + "; ".join(bad))
    if m.low_rank_tp == "naive" and r % tp:
        raise ConfigError(f"model.low_rank={r} is not divisible by parallel.tensor={tp} "
                          "(low_rank_tp='naive' splits A's r rows over TP)")
    if m.low_rank_tp == "bottleneck":
        if m.hidden_size % tp:
            raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by parallel.tensor={tp} "
                              "(low_rank_tp='bottleneck' splits the residual stream along h)")
        if sequence_parallel and tp > 1:
            raise ConfigError("model.low_rank_tp='bottleneck' does not take parallel.sequence_parallel=true "
                              "(its residual stream is split along h instead; use low_rank_tp='naive' for SP)")
        if m.normalization != "rmsnorm":
            raise ConfigError(f"model.low_rank_tp='bottleneck' needs model.normalization='rmsnorm' (is "
                              f"{m.normalization!r}): its online norm reduces one sum of squares per token")


def check_low_rank(cfg: Config, world: int | None) -> None:
    """The config validator of :func:`check_low_rank_model` (whole-config fields included)."""
    p = cfg.parallel
    check_low_rank_model(cfg.model, p.tensor, p.sequence_parallel, p.context, cfg.train.fp8)
