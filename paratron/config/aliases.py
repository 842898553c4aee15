"""Megatron-LM flag aliases, so users' launch scripts carry over."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

from .errors import ConfigError
from .loading import load_config
from .model_shape import moe_layer_fields
from .sections import Config


# ------------------------------------------------------------------------------------------
MEGATRON_ALIASES: dict[str, str] = {
    "--tensor-model-parallel-size": "parallel.tensor",
    "--pipeline-model-parallel-size": "parallel.pipeline",
    "--virtual-pipeline-model-parallel-size": "parallel.virtual_pipeline",
    "--context-parallel-size": "parallel.context",
    "--cp-comm-type": "parallel.context_algorithm",
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
    "--moe-token-dispatcher-type": "model.moe_token_dispatcher",
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
    "--optimizer": "optimizer.name",
    "--muon-momentum": "optimizer.muon_momentum",
    "--muon-num-ns-steps": "optimizer.muon_num_ns_steps",
    "--muon-scale-mode": "optimizer.muon_scale_mode",
    "--muon-extra-scale-factor": "optimizer.muon_extra_scale_factor",
    "--exp-avg-dtype": "optimizer.exp_avg_dtype",
    "--exp-avg-sq-dtype": "optimizer.exp_avg_sq_dtype",
    "--data-path": "data.data_path",
    "--split": "data.split",
    "--vocab-file": "data.vocab_file",
    "--merge-file": "data.merge_file",
    "--save": "checkpoint.save",
    "--load": "checkpoint.load",
    "--save-interval": "checkpoint.interval",
    "--log-interval": "logging.log_interval",
    "--profile-ranks": "train.profile_ranks",
    "--wandb-project": "train.wandb_project",
    "--wandb-exp-name": "train.wandb_exp_name",
    # DeepSeek-V3 routing and Qwen3 attention (Megatron-Core's MoE and attention flags)
    "--kv-channels": "model.kv_channels",
    "--moe-router-score-function": "model.moe_router_score",
    "--moe-router-topk-scaling-factor": "model.moe_router_topk_scaling_factor",
    "--moe-router-num-groups": "model.moe_router_num_groups",
    "--moe-router-group-topk": "model.moe_router_group_topk",
    "--moe-router-bias-update-rate": "model.moe_router_bias_update_rate",
    "--moe-layer-freq": "model.moe_layer_freq",
    "--moe-ffn-hidden-size": "model.moe_ffn_hidden_size",
    "--moe-shared-expert-intermediate-size": "model.moe_shared_expert_ffn_hidden_size",
    "--moe-aux-loss-coeff": "model.moe_aux_loss_coeff",
    "--moe-z-loss-coeff": "model.moe_z_loss_coeff",
    "--q-lora-rank": "model.q_lora_rank",
    "--kv-lora-rank": "model.kv_lora_rank",
    "--qk-head-dim": "model.qk_head_dim",
    "--qk-pos-emb-head-dim": "model.qk_pos_emb_head_dim",
    "--v-head-dim": "model.v_head_dim",
    "--mtp-num-layers": "model.mtp_num_layers",
    "--mtp-loss-scaling-factor": "model.mtp_loss_scaling_factor",
    # FP8 linears (paratron/layers/fp8.py): Megatron's recipe names map onto train.fp8.
    "--fp8-format": "train.fp8_format",
    "--fp8-recipe": "train.fp8",
}
"""Megatron-LM flag -> paratron key, for flags that take a value."""

MEGATRON_SWITCHES: dict[str, tuple[str, str]] = {
    "--sequence-parallel": ("parallel.sequence_parallel", "true"),
    "--use-distributed-optimizer": ("parallel.zero", "1"),
    "--reset-position-ids": ("data.reset_position_ids", "true"),
    "--reset-attention-mask": ("data.reset_attention_mask", "true"),
    "--eod-mask-loss": ("data.eod_mask_loss", "true"),
    "--sft": ("data.format", "chat"),
    "--bf16": ("train.precision", "bf16"),
    "--fp16": ("train.precision", "fp16"),
    "--swiglu": ("model.activation", "swiglu"),
    "--untie-embeddings-and-output-weights": ("model.tie_embeddings", "false"),
    "--disable-bias-linear": ("model.add_bias_linear", "false"),
    "--deterministic-mode": ("train.deterministic", "true"),
    "--overlap-moe-expert-parallel-comm": ("parallel.overlap_moe_expert_parallel_comm", "true"),
    # Both turn on train.profile_steps (torch.profiler; paratron has no nsys mode).
    "--profile": ("_profile", "true"),
    "--use-pytorch-profiler": ("_profile", "true"),
    "--qk-layernorm": ("model.qk_layernorm", "true"),
    "--moe-router-enable-expert-bias": ("model.moe_router_enable_expert_bias", "true"),
    "--multi-latent-attention": ("model.multi_latent_attention", "true"),
    "--muon-no-split-qkv": ("optimizer.muon_split_qkv", "false"),
    "--finetune": ("checkpoint.finetune", "true"),
    "--no-load-optim": ("checkpoint.load_optimizer", "false"),
}
"""Megatron-LM flags without a value -> (paratron key, value)."""

DERIVED_ALIASES: dict[str, str] = {
    "--num-layers-per-virtual-pipeline-stage": "_layers_per_virtual_stage",
    "--profile-step-start": "_profile_step_start",
    "--profile-step-end": "_profile_step_end",
}
"""Megatron-LM flags whose paratron value is derived after the other overrides
(:func:`finish_aliases`), passed on as ``_name=value``."""

MULTI_VALUE = ("--data-path", "--profile-ranks")
"""Flags that take several values (Megatron's ``nargs='+'``)."""

MEGATRON_PROFILE_STEPS = (10, 12)
"""Megatron's ``--profile-step-start`` / ``--profile-step-end`` defaults."""


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
        if flag in MEGATRON_ALIASES or flag in DERIVED_ALIASES:
            values = [inline] if eq else []
            j = i + 1
            if not eq:
                # --data-path (weights and prefixes) and --profile-ranks take several values, the rest one.
                while j < len(argv) and not argv[j].startswith("--"):
                    values.append(argv[j])
                    j += 1
                    if flag not in MULTI_VALUE:
                        break
            if not values:
                raise ConfigError(f"{flag} needs a value")
            key = MEGATRON_ALIASES.get(flag) or DERIVED_ALIASES[flag]
            if flag == "--moe-layer-freq" and not values[0].strip().isdigit():
                key = "_moe_layer_pattern"  # Megatron's per-layer list, e.g. ([0]*1+[1]*3)
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


def _profile_steps(cfg: Config, given: dict[str, str]) -> None:
    """``train.profile_steps`` from Megatron's profiler flags. Megatron's torch profiler is
    active for ``end - start`` steps from ``start`` (a half-open range), so ``[start, end - 1]``
    here, with its defaults for a flag left out."""
    if not given:
        return
    try:
        start = int(given.get("_profile_step_start", MEGATRON_PROFILE_STEPS[0]))
        end = int(given.get("_profile_step_end", MEGATRON_PROFILE_STEPS[1]))
    except ValueError:
        raise ConfigError(f"--profile-step-start/--profile-step-end must be integers, got {given}") from None
    if end <= start or start < 1:
        raise ConfigError(f"--profile-step-start={start} --profile-step-end={end}: need 1 <= start < end "
                          "(the profiler runs steps start .. end-1)")
    cfg.train.profile_steps = [start, end - 1]


def _pattern_values(node: ast.AST, text: str) -> list[int]:
    """The list an expression of list literals of ints, ``*`` by an int and ``+`` stands for."""
    if isinstance(node, ast.List) and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts):
        return [e.value for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _pattern_values(node.left, text) + _pattern_values(node.right, text)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.right, ast.Constant) \
            and type(node.right.value) is int:
        return _pattern_values(node.left, text) * node.right.value
    raise ConfigError(f"--moe-layer-freq={text!r}: expected an integer or a list such as ([0]*1+[1]*3)")


def moe_layer_pattern(text: str, num_layers: int) -> tuple[int, int]:
    """Megatron's ``--moe-layer-freq`` list (1 = MoE layer, 0 = dense, one entry per layer) as
    ``(first_k_dense_replace, moe_layer_freq)``: layer ``i`` is MoE iff ``i >= first_k`` and
    ``i % freq == 0`` (:func:`paratron.config.model_shape.is_moe_layer`).

    Raises:
        ConfigError: not such a list, a length other than ``num_layers``, or a pattern those two
            fields cannot express.
    """
    try:
        values = _pattern_values(ast.parse(text.strip(), mode="eval").body, text)
    except SyntaxError:
        raise ConfigError(f"--moe-layer-freq={text!r}: expected an integer or a list such as ([0]*1+[1]*3)") from None
    if len(values) != num_layers or set(values) - {0, 1}:
        raise ConfigError(f"--moe-layer-freq={text!r}: needs one 0 or 1 per layer (model.num_layers={num_layers})")
    fields = moe_layer_fields([bool(v) for v in values])
    if fields is not None:
        return fields
    raise ConfigError(f"--moe-layer-freq={text!r}: paratron expresses MoE layers as the layers i >= "
                      "model.first_k_dense_replace with i % model.moe_layer_freq == 0; this list is not of that form")


def finish_aliases(cfg: Config, overrides: list[str]) -> list[str]:
    """Resolve the derived aliases (``_layers_per_virtual_stage``, ``_moe_layer_pattern``, the
    profiler's steps) against ``cfg``; return the rest."""
    plain, profile = [], {}
    for item in overrides:
        k, _, v = item.partition("=")
        if k.startswith("_profile"):
            profile[k] = v
        elif k == "_moe_layer_pattern":
            cfg.model.first_k_dense_replace, cfg.model.moe_layer_freq = moe_layer_pattern(v, cfg.model.num_layers)
        elif k == "_layers_per_virtual_stage":
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
    _profile_steps(cfg, profile)
    return plain


def build_config(path: str | Path | None, overrides: list[str], *,
                 implied: Callable[[Config, set[str]], None] | None = None) -> Config:
    """Load ``path``, apply plain overrides in order (and ``implied``, as in
    :func:`~.loading.load_config`), then the derived Megatron aliases. A run builds its config
    through :func:`paratron.rules.build_config`."""
    cfg = load_config(path, [o for o in overrides if not o.startswith("_")], implied=implied)
    finish_aliases(cfg, overrides)
    return cfg
