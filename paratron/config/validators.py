"""Validation: small named rules, run before any process group exists.

Each rule takes ``(cfg, world_size_or_None)`` and raises :class:`ConfigError` naming the field,
its value and the rule, e.g. ``model.num_attention_heads=6 is not divisible by parallel.tensor=4``.
"""

from __future__ import annotations

from .errors import ConfigError
from .sections import Config


# ------------------------------------------------------------------------------------------
def _positive(cfg: Config, world: int | None) -> None:
    checks = [
        ("model.num_layers", cfg.model.num_layers), ("model.hidden_size", cfg.model.hidden_size),
        ("model.num_attention_heads", cfg.model.num_attention_heads),
        ("model.seq_length", cfg.model.seq_length),
        ("parallel.tensor", cfg.parallel.tensor), ("parallel.pipeline", cfg.parallel.pipeline),
        ("parallel.virtual_pipeline", cfg.parallel.virtual_pipeline),
        ("parallel.context", cfg.parallel.context), ("parallel.expert", cfg.parallel.expert),
        ("parallel.expert_tensor", cfg.parallel.expert_tensor),
        ("train.micro_batch_size", cfg.train.micro_batch_size),
        ("train.global_batch_size", cfg.train.global_batch_size),
        ("train.train_iters", cfg.train.train_iters),
        ("make_vocab_size_divisible_by", cfg.model.make_vocab_size_divisible_by),
    ]
    for name, v in checks:
        if v is None or v < 1:
            raise ConfigError(f"{name}={v} must be a positive integer (>= 1)")
    for name, v in (("model.num_query_groups", cfg.model.num_query_groups),
                    ("model.ffn_hidden_size", cfg.model.ffn_hidden_size),
                    ("model.vocab_size", cfg.model.vocab_size)):
        if v is not None and v < 1:
            raise ConfigError(f"{name}={v} must be a positive integer (>= 1)")
    if cfg.optimizer.lr < 0:
        raise ConfigError(f"optimizer.lr={cfg.optimizer.lr} must be >= 0")
    for name, v in (("model.hidden_dropout", cfg.model.hidden_dropout),
                    ("model.attention_dropout", cfg.model.attention_dropout)):
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"{name}={v} must be in [0, 1)")


def _world_divisible(cfg: Config, world: int | None) -> None:
    if world is None:
        return
    p = cfg.parallel
    mp_ = p.tensor * p.context * p.pipeline
    if world % mp_:
        raise ConfigError(
            f"world size {world} is not divisible by parallel.tensor*parallel.context*parallel.pipeline"
            f" = {p.tensor}*{p.context}*{p.pipeline} = {mp_}")
    ex = p.expert_tensor * p.expert * p.pipeline
    if world % ex:
        raise ConfigError(
            f"world size {world} is not divisible by parallel.expert_tensor*parallel.expert*"
            f"parallel.pipeline = {p.expert_tensor}*{p.expert}*{p.pipeline} = {ex}")


def _heads(cfg: Config, world: int | None) -> None:
    m, tp = cfg.model, cfg.parallel.tensor
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % tp:
        raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                          f"parallel.tensor={tp}")
    g = m.num_query_groups
    if g is not None:
        if m.num_attention_heads % g:
            raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                              f"model.num_query_groups={g}")
        if g % tp:
            raise ConfigError(f"model.num_query_groups={g} is not divisible by parallel.tensor={tp}")
    if m.position_embedding_type == "rope" and (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(f"RoPE needs an even head dim; model.hidden_size/num_attention_heads = "
                          f"{m.hidden_size // m.num_attention_heads}")


def _ffn(cfg: Config, world: int | None) -> None:
    m, tp = cfg.model, cfg.parallel.tensor
    if m.ffn_hidden_size is not None and m.ffn_hidden_size % tp:
        raise ConfigError(f"model.ffn_hidden_size={m.ffn_hidden_size} is not divisible by parallel.tensor={tp}")


def _batch(cfg: Config, world: int | None) -> None:
    t, p = cfg.train, cfg.parallel
    dp = None
    if world is not None and world % (p.tensor * p.context * p.pipeline) == 0:
        dp = world // (p.tensor * p.context * p.pipeline)
    unit = t.micro_batch_size * (dp or 1)
    if t.global_batch_size % unit:
        where = f"train.micro_batch_size*dp = {t.micro_batch_size}*{dp}" if dp else \
            f"train.micro_batch_size={t.micro_batch_size}"
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by {where}")


def _sequence(cfg: Config, world: int | None) -> None:
    p, s = cfg.parallel, cfg.model.seq_length
    if p.sequence_parallel and s % p.tensor:
        raise ConfigError(f"model.seq_length={s} is not divisible by parallel.tensor={p.tensor}, "
                          "which sequence parallelism needs (parallel.sequence_parallel=true)")
    if p.context > 1 and s % (2 * p.context):
        raise ConfigError(f"model.seq_length={s} is not divisible by 2*parallel.context={2 * p.context}")
    if m_pos := cfg.model.max_position_embeddings:
        if cfg.model.position_embedding_type == "learned" and s > m_pos:
            raise ConfigError(f"model.seq_length={s} exceeds model.max_position_embeddings={m_pos}")


def _pipeline_layers(cfg: Config, world: int | None) -> None:
    p, L = cfg.parallel, cfg.model.num_layers
    stages = p.pipeline * p.virtual_pipeline
    if p.pipeline_layout is not None:
        if len(p.pipeline_layout) != stages:
            raise ConfigError(f"parallel.pipeline_layout={p.pipeline_layout} has {len(p.pipeline_layout)} "
                              f"entries; it needs parallel.pipeline*virtual_pipeline = {stages}")
        if sum(p.pipeline_layout) != L or min(p.pipeline_layout) < 0:
            raise ConfigError(f"parallel.pipeline_layout={p.pipeline_layout} must be non-negative and "
                              f"sum to model.num_layers={L}")
    elif L % stages:
        raise ConfigError(f"model.num_layers={L} is not divisible by parallel.pipeline*virtual_pipeline"
                          f" = {p.pipeline}*{p.virtual_pipeline} = {stages}; set parallel.pipeline_layout "
                          "for an uneven split")
    if p.virtual_pipeline > 1 and p.schedule not in ("interleaved", "zbv") and p.schedule in (
            "gpipe", "1f1b", "zb-h1"):
        raise ConfigError(f"parallel.virtual_pipeline={p.virtual_pipeline} needs an interleaved schedule; "
                          f"parallel.schedule={p.schedule!r} runs one chunk per rank")
    if p.schedule == "zbv" and p.virtual_pipeline != 2:
        raise ConfigError(f"parallel.schedule='zbv' places two chunks per rank (V shape); "
                          f"set parallel.virtual_pipeline=2, not {p.virtual_pipeline}")


def _experts(cfg: Config, world: int | None) -> None:
    m, p = cfg.model, cfg.parallel
    if m.num_experts < 0:
        raise ConfigError(f"model.num_experts={m.num_experts} must be >= 0")
    if m.num_experts == 0:
        if p.expert > 1:
            raise ConfigError(f"parallel.expert={p.expert} needs model.num_experts > 0")
        return
    if m.num_experts % p.expert:
        raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by parallel.expert={p.expert}")
    if not 1 <= m.moe_top_k <= m.num_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in [1, model.num_experts={m.num_experts}]")
    if m.moe_layer_freq < 1:
        raise ConfigError(f"model.moe_layer_freq={m.moe_layer_freq} must be >= 1")
    if m.moe_capacity_factor is not None and m.moe_capacity_factor <= 0:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} must be > 0 (or unset: dropless)")
    if m.moe_pad_to_capacity and m.moe_capacity_factor is None:
        raise ConfigError("model.moe_pad_to_capacity=true needs model.moe_capacity_factor to be set")
    width = m.moe_ffn_hidden_size if m.moe_ffn_hidden_size is not None else m.ffn_hidden_size
    if width is not None and width % p.expert_tensor:
        field = "moe_ffn_hidden_size" if m.moe_ffn_hidden_size is not None else "ffn_hidden_size"
        raise ConfigError(f"model.{field}={width} (the expert width) is not divisible by "
                          f"parallel.expert_tensor={p.expert_tensor}")
    shared = m.moe_shared_expert_ffn_hidden_size
    if shared is not None and shared % p.tensor:
        raise ConfigError(f"model.moe_shared_expert_ffn_hidden_size={shared} is not divisible by "
                          f"parallel.tensor={p.tensor}")


def _zero(cfg: Config, world: int | None) -> None:
    if cfg.parallel.zero not in (0, 1):
        raise ConfigError(f"parallel.zero={cfg.parallel.zero} must be 0 (DDP) or 1 (ZeRO-1)")
    if cfg.parallel.context > 1:
        raise ConfigError(f"parallel.context={cfg.parallel.context}: context parallelism is not "
                          "implemented yet; use 1")


def _split(cfg: Config, world: int | None) -> None:
    parts = cfg.data.split.replace("/", ",").split(",")
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        raise ConfigError(f"data.split={cfg.data.split!r} must be comma-separated numbers like '969,30,1'") from None
    if len(vals) > 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ConfigError(f"data.split={cfg.data.split!r} must be up to 3 non-negative numbers with a positive sum")


def _lr_schedule(cfg: Config, world: int | None) -> None:
    o = cfg.optimizer
    decay = o.lr_decay_iters if o.lr_decay_iters is not None else cfg.train.train_iters
    if not 0 <= o.lr_warmup_iters <= decay:
        src = "optimizer.lr_decay_iters" if o.lr_decay_iters is not None else "train.train_iters"
        raise ConfigError(f"optimizer.lr_warmup_iters={o.lr_warmup_iters} must be in [0, {src}={decay}]")
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be <= optimizer.lr={o.lr}")


VALIDATORS = [_positive, _lr_schedule, _world_divisible, _heads, _ffn, _batch, _sequence, _pipeline_layers,
              _experts, _zero, _split]
"""Every config rule, in order. Each takes ``(cfg, world_size_or_None)`` and raises ConfigError."""


def validate(cfg: Config, world_size: int | None = None) -> Config:
    """Run every validator; call before creating any process group.

    Raises:
        ConfigError: the first rule broken, naming field, value and rule.
    """
    for rule in VALIDATORS:
        rule(cfg, world_size)
    return cfg
