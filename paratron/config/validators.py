"""The config's own rules: small named checks that read the config alone, run before any process
group exists.

Each rule takes ``(cfg, world_size_or_None)`` and raises :class:`ConfigError` naming the field,
its value and the rule, e.g. ``model.num_attention_heads=6 is not divisible by parallel.tensor=4``.

A rule owned by another module is called, not written again: the model shape and MoE rules
(:mod:`.model_shape`, also run by the model constructors). Rules that ask a package above the
config (the rank grid, the pipeline split and schedules, the token dispatchers, the optimizer,
the checkpoint manager) live in :mod:`paratron.rules`, which runs these and those in one order
(:data:`paratron.rules.VALIDATORS`); the config imports nothing of those packages.
"""

from __future__ import annotations

import dataclasses
import math

from . import model_shape
from .context_rules import check_context
from .failslow_rules import check_failslow
from .low_rank_rules import check_low_rank
from .observe_rules import check_observability
from .offload_rules import check_activation_offload
from .record_rules import check_records
from .token_rules import check_microbatch_tokens, token_balanced
from .errors import ConfigError
from .sections import Config


# ------------------------------------------------------------------------------------------
def _positive(cfg: Config, world: int | None) -> None:
    checks = [
        ("model.num_layers", cfg.model.num_layers),
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
    for name, v in (("parallel.timeout_s", cfg.parallel.timeout_s),
                    ("parallel.hang_timeout_s", cfg.parallel.hang_timeout_s)):
        if not 0 <= v < float("inf"):
            raise ConfigError(f"{name}={v} must be a finite number of seconds >= 0")
    if cfg.parallel.check_collectives and cfg.parallel.hang_timeout_s == 0:
        raise ConfigError("parallel.check_collectives=true needs the hang watchdog's flight recorder, "
                          "which parallel.hang_timeout_s=0 turns off: set hang_timeout_s > 0")
    if cfg.optimizer.lr < 0:
        raise ConfigError(f"optimizer.lr={cfg.optimizer.lr} must be >= 0")
    if not 0.0 <= cfg.optimizer.offload_fraction <= 1.0:
        raise ConfigError(f"optimizer.offload_fraction={cfg.optimizer.offload_fraction} must be in [0, 1]")
    if cfg.optimizer.cpu_offload and cfg.optimizer.name == "muon":
        raise ConfigError("optimizer.cpu_offload is not supported with optimizer.name='muon' (its "
                          "orthogonalisation runs on the device); use adamw or sgd, or turn the offload off")
    if cfg.optimizer.muon_num_ns_steps < 1:
        raise ConfigError(f"optimizer.muon_num_ns_steps={cfg.optimizer.muon_num_ns_steps} must be >= 1")
    for name, v in (("model.hidden_dropout", cfg.model.hidden_dropout),
                    ("model.attention_dropout", cfg.model.attention_dropout),
                    ("optimizer.muon_momentum", cfg.optimizer.muon_momentum)):
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"{name}={v} must be in [0, 1)")


def _finite(cfg: Config, world: int | None) -> None:
    """Every float field of every section is a finite number (``optimizer.lr = nan`` or ``inf``
    would poison the first step)."""
    for section, sub in vars(cfg).items():  # vars(): the planner runs this rule on ~1e5 layouts
        if not dataclasses.is_dataclass(sub):
            continue
        for name, v in vars(sub).items():
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{section}.{name}={v} must be a finite number")


def _nonfinite_policy(cfg: Config, world: int | None) -> None:
    t = cfg.train  # train.nonfinite itself is checked against its Literal type when loading
    if t.max_consecutive_skips < 1:
        raise ConfigError(f"train.max_consecutive_skips={t.max_consecutive_skips} must be >= 1")


def _model(cfg: Config, world: int | None) -> None:
    model_shape.check_shape(cfg.model, cfg.parallel.tensor)


def _activation_offload(cfg: Config, world: int | None) -> None:
    if not cfg.model.activation_offload:
        return
    err = check_activation_offload(cfg.model.activation_offload, cfg.model.recompute, cfg.model.compile)
    if err:
        raise ConfigError(err)


def data_parallel_size(cfg: Config, world: int | None) -> int | None:
    """``world / (tp * cp * pp)``, or None without a world size (or when it does not divide)."""
    p = cfg.parallel
    mp = p.tensor * p.context * p.pipeline
    return world // mp if world is not None and world % mp == 0 else None


def _batch(cfg: Config, world: int | None) -> None:
    t, dp = cfg.train, data_parallel_size(cfg, world)
    if token_balanced(cfg):
        return  # the global batch counts documents (token_rules)
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


def _mtp_last_stage(cfg: Config, world: int | None) -> None:
    """The MTP modules (one transformer layer each) run on the last pipeline stage, after its
    own layers: an explicit ``parallel.pipeline_layout`` must leave it room for them, i.e. the
    last stage's layers plus ``model.mtp_num_layers`` may not exceed the largest other stage
    (Megatron-LM's advice for DeepSeek-V3 layouts: fewer layers on the stage with the MTP)."""
    p, d = cfg.parallel, cfg.model.mtp_num_layers
    layout = p.pipeline_layout
    if not d or not layout or len(layout) < 2:
        return
    if layout[-1] + d > max(layout[:-1]):
        raise ConfigError(f"parallel.pipeline_layout={layout} leaves the last stage no room for the "
                          f"model.mtp_num_layers={d} MTP modules it runs: its {layout[-1]} layers + {d} exceed the "
                          f"largest other stage ({max(layout[:-1])}); move layers off the last stage")


def _link_latency(cfg: Config, world: int | None) -> None:
    p = cfg.parallel
    lat = p.pipeline_link_latency_ms
    if lat is not None and (len(lat) != p.pipeline - 1 or not all(math.isfinite(x) and x >= 0 for x in lat)):
        raise ConfigError(f"parallel.pipeline_link_latency_ms={lat} must list parallel.pipeline-1={p.pipeline - 1} "
                          "finite latencies >= 0 (entry k: the link between pipeline ranks k and k+1)")
    t = p.pipeline_microbatch_time_ms
    if t is not None and not (math.isfinite(t) and t > 0):
        raise ConfigError(f"parallel.pipeline_microbatch_time_ms={t} must be a finite time > 0 (ms), or unset "
                          "to measure it over the first step")


def _experts(cfg: Config, world: int | None) -> None:
    p = cfg.parallel
    model_shape.check_moe(cfg.model, tp=p.tensor, ep=p.expert, expert_tp=p.expert_tensor)


def _dualpipev_zero3(cfg: Config, world: int | None) -> None:
    """DualPipeV's lists are made of FB pairs (one microbatch's backward run inside another's
    forward); ZeRO-3's per-unit free has only been proved for one microbatch in a unit at a
    time (the same rule as parallel.overlap_moe_expert_parallel_comm)."""
    if cfg.parallel.schedule == "dualpipev" and cfg.parallel.zero == 3:
        raise ConfigError("parallel.schedule='dualpipev' runs one microbatch's backward in the middle of "
                          "another's forward (FB pairs), but parallel.zero=3 frees each layer's params after "
                          "its forward and backward: use parallel.zero <= 2 or parallel.schedule='zbv'")


def _split(cfg: Config, world: int | None) -> None:
    parts = cfg.data.split.replace("/", ",").split(",")
    try:
        vals = [float(x) for x in parts]
    except ValueError:
        hint = " (the split of data.hf_dataset to read is data.hf_split)" if cfg.data.hf_dataset else ""
        raise ConfigError(f"data.split={cfg.data.split!r} must be comma-separated numbers like '969,30,1'{hint}") from None
    if len(vals) > 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise ConfigError(f"data.split={cfg.data.split!r} must be up to 3 non-negative numbers with a positive sum")


def _lr_decay_iters(cfg: Config) -> tuple[str, int]:
    o = cfg.optimizer
    if o.lr_decay_iters is not None:
        return "optimizer.lr_decay_iters", o.lr_decay_iters
    return "train.train_iters", cfg.train.train_iters


def _fp8(cfg: Config, world: int | None) -> None:
    t = cfg.train
    if t.fp8 not in (None, "tensorwise", "rowwise"):
        raise ConfigError(f"train.fp8={t.fp8!r} must be 'tensorwise' or 'rowwise' (Megatron's delayed, "
                          "mxfp8 and blockwise recipes are not implemented)")
    if t.fp8_format not in (None, "e4m3", "hybrid"):
        raise ConfigError(f"train.fp8_format={t.fp8_format!r} must be 'e4m3' or 'hybrid'")
    if t.fp8_param_gather and (cfg.parallel.zero != 3 or (t.fp8 is None and t.fp8_format is None)):
        raise ConfigError(f"train.fp8_param_gather=true needs parallel.zero=3 (is {cfg.parallel.zero}) "
                          "and FP8 on (train.fp8 or train.fp8_format)")
    if (t.fp8 is not None or t.fp8_format is not None) and cfg.parallel.context > 1:
        # CP splits each sequence: activation amaxes would be per chunk, unlike at CP=1.
        raise ConfigError(f"train.fp8 needs parallel.context=1 (is {cfg.parallel.context}): the FP8 "
                          "scales are not reduced over context-parallel ranks")
    if t.fp8_param_gather and t.fp8 == "rowwise":
        # The gather casts each weight with one scale; rowwise linears cast it per row (forward)
        # and per column (input grad), so a weight gathered in FP8 would be rounded twice.
        raise ConfigError("train.fp8_param_gather=true needs train.fp8='tensorwise' (is 'rowwise'): the "
                          "gathered weight's one scale is not the rowwise linears' per-row scales")


def _save_peft(cfg: Config, world: int | None) -> None:
    if cfg.checkpoint.save_peft and cfg.model.lora_rank <= 0:
        raise ConfigError(f"checkpoint.save_peft={cfg.checkpoint.save_peft} (--save-peft) needs a LoRA run: "
                          f"model.lora_rank > 0 (is {cfg.model.lora_rank})")


def _encoder_placement(cfg: Config, world: int | None) -> None:
    """``parallel.encoder_placement = "optimus"`` places a vision encoder's work; the models
    ``paratron train`` builds are text-only, so the key would do nothing there. The
    vision-language model runs through the pipeline API and ``paratron simulate``
    (docs/optimus.md)."""
    if cfg.parallel.encoder_placement != "stage0":
        raise ConfigError(f"parallel.encoder_placement={cfg.parallel.encoder_placement!r}: paratron train builds "
                          "text-only models (no vision encoder to place); the Optimus placement runs through "
                          "the pipeline API (paratron.models.vlm) and paratron simulate --encoder-placement, "
                          "see docs/optimus.md")


SECTION_RULES = {rule.__name__: rule for rule in (
    _finite, _positive, _nonfinite_policy, _model, _activation_offload, _batch, _sequence, _link_latency,
    _mtp_last_stage, _dualpipev_zero3, _experts, _fp8, _save_peft, _split, check_context,
    check_microbatch_tokens, check_observability, check_records, check_low_rank, _encoder_placement,
    check_failslow)}
"""The rules that read the config alone, by name; :data:`paratron.rules.VALIDATORS` puts them in
order among the rules that ask the owners (schedules, dispatchers, optimizer, checkpoints)."""


def config_warnings(cfg: Config) -> list[str]:
    """Allowed but probably unintended settings, one line each (the launcher prints them once)."""
    out = []
    o = cfg.optimizer
    src, decay = _lr_decay_iters(cfg)
    if o.lr_warmup_iters > decay:
        out.append(f"optimizer.lr_warmup_iters={o.lr_warmup_iters} > {src}={decay}: the warmup will not "
                   f"finish; the lr stays below optimizer.lr={o.lr} for the whole run")
    c = cfg.checkpoint
    if c.finetune and not c.load and not c.load_hf:
        out.append("checkpoint.finetune=true without checkpoint.load: there are no weights to fine-tune "
                   "from, so the run starts from random weights")
    p = cfg.parallel
    if p.sequence_parallel and p.tensor == 1:  # Megatron-LM turns it off here; it changes nothing
        out.append("parallel.sequence_parallel=true with parallel.tensor=1: there is no TP group to split the "
                   "sequence over, so it has no effect (it splits activations over the tensor-parallel ranks)")
    return out
