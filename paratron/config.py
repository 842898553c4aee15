"""Run configuration: dataclasses, TOML loading, ``--set section.key=value`` overrides, validation.

A run is described by one :class:`Config` with seven sections (model, parallel, train, optimizer,
data, checkpoint, logging). Each field has a docstring comment under it. Every rule is a small
named validator in :data:`VALIDATORS`; :func:`validate` runs them all *before* any process group
exists and raises :class:`ConfigError` whose message names the field, its value and the rule, e.g.
``model.num_attention_heads=6 is not divisible by parallel.tensor=4``.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the field, value and rule."""


# ------------------------------------------------------------------------------------------
# Sections
# ------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 256
    """Model width h."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """KV groups for grouped-query attention; None means multi-head (= num_attention_heads)."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; None means 4h (GELU) or Llama's rounded 8h/3 (SwiGLU)."""
    vocab_size: Optional[int] = None
    """Vocabulary size before padding; None takes it from the tokenizer."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocab is a multiple of this times parallel.tensor."""
    seq_length: int = 256
    """Tokens per sample."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position table; None means seq_length."""
    normalization: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_epsilon: float = 1e-5
    position_embedding_type: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"
    """gelu (erf), gelu_tanh (the tanh approximation GPT-2 uses), or swiglu (gated, Llama)."""
    add_bias_linear: bool = True
    """Biases in the attention and MLP linears."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    recompute: Literal["none", "full", "selective"] = "none"
    """Activation recompute (Korthikanti et al. 2022): whole layer, or the attention core only."""
    block: str = "transformer"
    """Name of the transformer block in the block registry."""
    # Mixture of experts (num_experts = 0 means dense).
    num_experts: int = 0
    moe_top_k: int = 2
    moe_router_score: Literal["softmax", "sigmoid"] = "softmax"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    moe_capacity_factor: Optional[float] = None
    """None means dropless."""
    moe_layer_freq: int = 1
    """Every k-th layer is an MoE layer (1 = every layer)."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of one expert; None means ffn_hidden_size."""
    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    """Inner width of the shared expert; None means no shared expert."""
    moe_token_dispatcher: str = "alltoall"
    """Token dispatcher registry name: alltoall or allgather."""
    moe_pad_to_capacity: bool = False
    """With a capacity factor, pad every expert's rows to its capacity (static shapes)."""


@dataclass
class ParallelConfig:
    tensor: int = 1
    """Tensor-parallel size."""
    pipeline: int = 1
    """Pipeline-parallel size."""
    virtual_pipeline: int = 1
    """Virtual pipeline stages (model chunks) per rank."""
    context: int = 1
    """Context-parallel size."""
    expert: int = 1
    """Expert-parallel size."""
    expert_tensor: int = 1
    """Tensor-parallel size of expert layers."""
    sequence_parallel: bool = False
    zero: int = 0
    """0: plain DDP; 1: ZeRO-1 distributed optimizer."""
    schedule: str = "1f1b"
    """Pipeline schedule registry name: gpipe, 1f1b, interleaved, zb-h1, zbv, or a registered one."""
    pipeline_layout: Optional[list[int]] = None
    """Transformer layers per pipeline stage (virtual stages in order); None splits evenly."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying axis first."""
    overlap_grad_reduce: bool = True
    """Start each gradient bucket's reduction as soon as its grads are ready."""
    bucket_size_mb: float = 40.0
    """Gradient bucket size in MiB."""
    timeout_s: float = 600.0
    """Collective timeout; a hang becomes an error after this long."""


@dataclass
class TrainConfig:
    train_iters: int = 200
    seed: int = 1234
    micro_batch_size: int = 4
    global_batch_size: int = 16
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    deterministic: bool = False
    """Bitwise-repeatable CPU fp32 runs."""
    eval_interval: int = 50
    eval_iters: int = 4
    callbacks: list[str] = field(default_factory=list)
    """Import paths ``module:Class`` of training-loop callbacks (plugins)."""
    peak_flops_per_device: Optional[float] = None
    """Peak FLOP/s of one device for MFU; None looks it up (GPU) or measures it (CPU)."""
    sample_prompt: Optional[str] = None
    """When set, rank 0 prints a text sample from the final checkpoint, continuing this prompt."""
    sample_tokens: int = 64


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 1.0
    """Max global grad norm; 0 disables clipping."""
    lr_decay_style: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    """None means train.train_iters."""
    lr_wsd_decay_iters: Optional[int] = None
    """Length of WSD's final decay; None means 10% of lr_decay_iters."""
    initial_loss_scale: float = 65536.0
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)
    """Indexed-dataset prefixes, optionally weighted Megatron-style: ["0.7", "a", "0.3", "b"]."""
    corpus: Optional[str] = None
    """A JSONL or text corpus preprocessed into data_path on first use."""
    json_key: str = "text"
    tokenizer_type: Literal["GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelBPE"] = "GPT2BPETokenizer"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    """A tokenizer.json (HuggingFaceTokenizer)."""
    tokenizer_vocab_size: int = 8192
    """Vocab size when training a byte-level BPE on the corpus."""
    split: str = "969,30,1"
    num_workers: int = 1
    """Preprocessing worker processes."""
    cache_dir: Optional[str] = None
    """Where sample-index files go; None means next to the data."""


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save checkpoints into."""
    load: Optional[str] = None
    """Directory to resume from (its ``latest``, or load_step)."""
    load_step: Optional[int] = None
    interval: int = 0
    """Save every N iterations (0: only at the end)."""
    keep_last: int = 3
    async_save: bool = False
    load_optimizer: bool = True


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard: bool = True
    progress: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


# ------------------------------------------------------------------------------------------
# Loading and overrides
# ------------------------------------------------------------------------------------------
def _section_types(section: str) -> dict[str, Any]:
    cls = type(getattr(Config(), section))
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` (from TOML or a string override) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(key, value, non_none[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} must be one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        (item,) = args
        if isinstance(value, str):
            value = [v for v in value.replace(",", " ").split() if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        return [_coerce(key, v, item) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be an integer")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be an integer") from None
        if f != int(f):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(f)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be a number") from None
    if tp is str:
        return str(value)
    return value


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set ``section.key`` to ``value``, converted to the field's type.

    Raises:
        ConfigError: unknown section or key (with a did-you-mean), or a value of the wrong type.
    """
    if "." not in dotted:
        raise ConfigError(f"override {dotted!r} must look like section.key=value, "
                          f"with section one of {', '.join(SECTIONS)}")
    section, key = dotted.split(".", 1)
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}{_did_you_mean(section, SECTIONS)}")
    types_ = _section_types(section)
    if key not in types_:
        elsewhere = [f"{s}.{key}" for s in SECTIONS if key in _section_types(s)]
        if elsewhere:  # the right key in the wrong section
            hint = f" (did you mean {elsewhere[0]!r}?)"
        else:
            hint = _did_you_mean(dotted, [f"{section}.{k}" for k in types_]) or _did_you_mean(
                dotted, [f"{s}.{k}" for s in SECTIONS for k in _section_types(s)])
        raise ConfigError(f"unknown config key {dotted!r}{hint}")
    setattr(getattr(cfg, section), key, _coerce(dotted, value, types_[key]))


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply ``["section.key=value", ...]`` in order."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        k, v = item.split("=", 1)
        set_value(cfg, k.strip(), v.strip())
    return cfg


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build a :class:`Config` from nested dicts (as TOML gives). Unknown keys are errors."""
    cfg = Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown config section [{section}]{_did_you_mean(section, SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        for key, value in values.items():
            try:
                set_value(cfg, f"{section}.{key}", value)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (or the defaults when ``path`` is None) and apply overrides.

    Raises:
        ConfigError: a missing or malformed file, an unknown key, a value of the wrong type.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    cfg = from_dict(data, str(path) if path else "<defaults>")
    return apply_overrides(cfg, list(overrides))


def to_toml(cfg: Config) -> str:
    """Render a config as TOML (None values are omitted)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is None:
                continue
            lines.append(f"{k} = {_toml_value(v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


# ------------------------------------------------------------------------------------------
# Validation: small named rules, run before any process group exists
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


# ------------------------------------------------------------------------------------------
# Megatron flag aliases, so users' launch scripts carry over
# ------------------------------------------------------------------------------------------
MEGATRON_ALIASES: dict[str, str] = {
    "--tensor-model-parallel-size": "parallel.tensor",
    "--pipeline-model-parallel-size": "parallel.pipeline",
    "--virtual-pipeline-model-parallel-size": "parallel.virtual_pipeline",
    "--context-parallel-size": "parallel.context",
    "--expert-model-parallel-size": "parallel.expert",
    "--expert-tensor-parallel-size": "parallel.expert_tensor",
    "--num-layers": "model.num_layers",
    "--hidden-size": "model.hidden_size",
    "--ffn-hidden-size": "model.ffn_hidden_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--num-query-groups": "model.num_query_groups",
    "--seq-length": "model.seq_length",
    "--max-position-embeddings": "model.max_position_embeddings",
    "--num-experts": "model.num_experts",
    "--moe-router-topk": "model.moe_top_k",
    "--micro-batch-size": "train.micro_batch_size",
    "--global-batch-size": "train.global_batch_size",
    "--train-iters": "train.train_iters",
    "--seed": "train.seed",
    "--eval-interval": "train.eval_interval",
    "--eval-iters": "train.eval_iters",
    "--lr": "optimizer.lr",
    "--min-lr": "optimizer.min_lr",
    "--weight-decay": "optimizer.weight_decay",
    "--clip-grad": "optimizer.clip_grad",
    "--lr-warmup-iters": "optimizer.lr_warmup_iters",
    "--lr-decay-style": "optimizer.lr_decay_style",
    "--data-path": "data.data_path",
    "--split": "data.split",
    "--vocab-file": "data.vocab_file",
    "--merge-file": "data.merge_file",
    "--save": "checkpoint.save",
    "--load": "checkpoint.load",
    "--save-interval": "checkpoint.interval",
    "--log-interval": "logging.log_interval",
}
"""Megatron-LM flag -> paratron key, for flags that take a value."""

MEGATRON_SWITCHES: dict[str, tuple[str, str]] = {
    "--sequence-parallel": ("parallel.sequence_parallel", "true"),
    "--use-distributed-optimizer": ("parallel.zero", "1"),
    "--bf16": ("train.precision", "bf16"),
    "--fp16": ("train.precision", "fp16"),
    "--swiglu": ("model.activation", "swiglu"),
    "--untie-embeddings-and-output-weights": ("model.tie_embeddings", "false"),
    "--disable-bias-linear": ("model.add_bias_linear", "false"),
    "--deterministic-mode": ("train.deterministic", "true"),
}
"""Megatron-LM flags without a value -> (paratron key, value)."""


def megatron_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Translate Megatron-style flags in ``argv`` into ``section.key=value`` overrides.

    ``--num-layers-per-virtual-pipeline-stage N`` becomes a ``parallel.virtual_pipeline`` value
    derived after the other overrides (``num_layers / (pipeline * N)``) and is returned as the
    special override ``_layers_per_virtual_stage=N``, which :func:`finish_aliases` resolves.

    Returns:
        (overrides, the remaining arguments)
    """
    out, rest, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        flag, eq, inline = a.partition("=")
        if flag in MEGATRON_ALIASES or flag == "--num-layers-per-virtual-pipeline-stage":
            values = [inline] if eq else []
            j = i + 1
            if not eq:
                # --data-path takes several values (weights and prefixes), the rest one.
                while j < len(argv) and not argv[j].startswith("--"):
                    values.append(argv[j])
                    j += 1
                    if flag != "--data-path":
                        break
            if not values:
                raise ConfigError(f"{flag} needs a value")
            key = MEGATRON_ALIASES.get(flag, "_layers_per_virtual_stage")
            out.append(f"{key}={' '.join(values)}")
            i = j
        elif flag in MEGATRON_SWITCHES:
            key, value = MEGATRON_SWITCHES[flag]
            out.append(f"{key}={value}")
            i += 1
        else:
            rest.append(a)
            i += 1
    return out, rest


def finish_aliases(cfg: Config, overrides: list[str]) -> list[str]:
    """Resolve the derived alias ``_layers_per_virtual_stage`` against ``cfg``; return the rest."""
    plain = []
    for item in overrides:
        k, _, v = item.partition("=")
        if k == "_layers_per_virtual_stage":
            n = int(v)
            stages = cfg.parallel.pipeline * n
            if n < 1 or cfg.model.num_layers % stages:
                raise ConfigError(
                    f"--num-layers-per-virtual-pipeline-stage={n}: model.num_layers={cfg.model.num_layers} "
                    f"is not divisible by parallel.pipeline*{n} = {stages}")
            cfg.parallel.virtual_pipeline = cfg.model.num_layers // stages
            if cfg.parallel.virtual_pipeline > 1 and cfg.parallel.schedule == "1f1b":
                cfg.parallel.schedule = "interleaved"
        else:
            plain.append(item)
    return plain


def build_config(path: str | Path | None, overrides: list[str]) -> Config:
    """Load ``path``, apply plain overrides in order, then the derived Megatron aliases."""
    cfg = load_config(path, [o for o in overrides if not o.startswith("_")])
    finish_aliases(cfg, overrides)
    return cfg
