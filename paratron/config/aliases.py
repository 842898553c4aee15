"""Megatron-LM flag aliases, so users' launch scripts carry over."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError
from .loading import load_config
from .sections import Config


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
}
"""Megatron-LM flag -> paratron key, for flags that take a value."""

MEGATRON_SWITCHES: dict[str, tuple[str, str]] = {
    "--sequence-parallel": ("parallel.sequence_parallel", "true"),
    "--use-distributed-optimizer": ("parallel.zero", "1"),
    "--reset-position-ids": ("data.reset_position_ids", "true"),
    "--reset-attention-mask": ("data.reset_attention_mask", "true"),
    "--eod-mask-loss": ("data.eod_mask_loss", "true"),
    "--bf16": ("train.precision", "bf16"),
    "--fp16": ("train.precision", "fp16"),
    "--swiglu": ("model.activation", "swiglu"),
    "--untie-embeddings-and-output-weights": ("model.tie_embeddings", "false"),
    "--disable-bias-linear": ("model.add_bias_linear", "false"),
    "--deterministic-mode": ("train.deterministic", "true"),
    "--overlap-moe-expert-parallel-comm": ("parallel.overlap_moe_expert_parallel_comm", "true"),
    "--muon-no-split-qkv": ("optimizer.muon_split_qkv", "false"),
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
