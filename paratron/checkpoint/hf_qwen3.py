"""Hugging Face ``Qwen3ForCausalLM`` and ``Qwen3MoeForCausalLM`` (Qwen3 technical report, Yang et
al. 2025, section 2).

Both are Llama blocks (:mod:`.hf` maps those) with QK-norm, an RMSNorm over each head's query and
key before RoPE (``self_attn.q_norm`` / ``k_norm``, ``[head_dim]`` each; paratron's
``model.qk_layernorm``, weights ``layers.{i}.attention.q_norm|k_norm.weight``), an explicit
``head_dim`` that need not be ``hidden_size / num_attention_heads`` (``model.kv_channels``), and
no biases. Qwen3-MoE's MLP is Qwen2-MoE's without the shared expert: a softmax router ``mlp.gate``
whose top-k probabilities are renormalised when ``norm_topk_prob``, and per-expert
``mlp.experts.{e}.gate_proj|up_proj|down_proj`` (:mod:`.hf_moe` maps those). Its dense layers
(``mlp_only_layers``, ``decoder_sparse_step``) become ``model.first_k_dense_replace`` and
``model.moe_layer_freq`` where those two can say which layers they are.
"""

from __future__ import annotations

from dataclasses import replace
import torch

from paratron.config import ConfigError, ModelConfig, model_shape

from .hf_recipe import Recipe
from .hf_moe import moe_export_problems

Tensors = dict[str, torch.Tensor]
FAMILIES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def qwen3_family(hf: dict) -> str | None:
    """``"qwen3"``, ``"qwen3_moe"`` or None for a ``config.json`` dict."""
    kind, archs = hf.get("model_type"), hf.get("architectures") or []
    for family, arch in FAMILIES.items():
        if kind == family or arch in archs:
            return family
    return None


def _moe_fields(hf: dict, num_layers: int, where: str) -> dict:
    only, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step", 1) or 1
    flags = [i not in only and (i + 1) % step == 0 for i in range(num_layers)]
    fields = model_shape.moe_layer_fields(flags) if any(flags) else None
    if fields is None:
        raise ConfigError(f"{where}: mlp_only_layers={sorted(only)}, decoder_sparse_step={step} make layers "
                          f"{[i for i, f in enumerate(flags) if f]} MoE; paratron's MoE layers are those i >= "
                          "model.first_k_dense_replace with i % model.moe_layer_freq == 0 (at least one)")
    first, freq = fields
    return dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")), moe_top_k=hf["num_experts_per_tok"],
                moe_router_score="softmax", moe_ffn_hidden_size=hf["moe_intermediate_size"],
                moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), moe_capacity_factor=None,
                first_k_dense_replace=first, moe_layer_freq=freq)


def qwen3_config(base: ModelConfig, hf: dict, family: str, where: str) -> ModelConfig:
    """``base`` (the Llama-style fields, ``kv_channels`` from ``head_dim``) with QK-norm and, for
    Qwen3-MoE, the MoE fields of ``hf``.

    Raises:
        ConfigError: sliding-window attention, or dense layers that ``first_k_dense_replace`` and
            ``moe_layer_freq`` cannot place (named with their fields).
    """
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise ConfigError(f"{where}: use_sliding_window={hf.get('use_sliding_window')}, layer_types="
                          f"{hf.get('layer_types')}: sliding-window attention is not supported")
    cfg = replace(base, qk_layernorm=True)
    if family == "qwen3":
        return cfg
    return replace(cfg, **_moe_fields(hf, cfg.num_layers, where))


def qk_norm_recipes(cfg: ModelConfig, h: str, p: str) -> dict[str, Recipe]:
    """Layer ``p``'s QK-norm weights from Hugging Face layer ``h``; each must be ``(head_dim,)``
    (one weight per head channel), else the build raises ValueError naming both sizes."""
    d = model_shape.head_dim(cfg)
    rule = f"QK-norm needs one weight per head channel, ({d},) (head_dim)"
    return {f"{p}.attention.{x}_norm.weight": Recipe((f"{h}.self_attn.{x}_norm.weight",), expect=(d,), rule=rule)
            for x in ("q", "k")}


def export_qk_norm(t: Tensors, h: str, p: str) -> Tensors:
    """Inverse of :func:`qk_norm_recipes`."""
    return {f"{h}.self_attn.{x}_norm.weight": t[f"{p}.attention.{x}_norm.weight"] for x in ("q", "k")}


def export_family(cfg: ModelConfig) -> str:
    """``"qwen3"`` or ``"qwen3_moe"`` for a QK-norm model that one of them computes exactly.

    Raises:
        ConfigError: naming each field that no Qwen3 model has.
    """
    broken = [] if cfg.normalization == "rmsnorm" else [f"model.normalization={cfg.normalization!r} (rmsnorm)"]
    if cfg.add_bias_linear or model_shape.qkv_bias(cfg):
        broken.append("biases (Qwen3 has none: model.add_bias_linear / add_qkv_bias false)")
    if cfg.num_experts:
        broken += moe_export_problems(cfg)
        if cfg.moe_shared_expert_ffn_hidden_size:
            broken.append("model.moe_shared_expert_ffn_hidden_size set (Qwen3-MoE has no shared expert)")
    elif (cfg.position_embedding_type, cfg.activation) != ("rope", "swiglu"):
        broken.append("Llama-style blocks (rope, swiglu)")
    if broken:
        raise ConfigError(f"QK-norm export (Qwen3ForCausalLM / Qwen3MoeForCausalLM) needs: {'; '.join(broken)}")
    return "qwen3_moe" if cfg.num_experts else "qwen3"


def export_config(cfg: ModelConfig, hf: dict, family: str) -> None:
    """Write the family's fields into ``hf`` (the Llama-style dict of :mod:`.hf`)."""
    hf.update(architectures=[FAMILIES[family]], model_type=family, use_sliding_window=False, sliding_window=None,
              layer_types=["full_attention"] * cfg.num_layers, max_window_layers=cfg.num_layers)
    hf.pop("mlp_bias", None)  # Llama's; Qwen3 has no biases
    if family == "qwen3_moe":
        hf.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_top_k,
                  moe_intermediate_size=model_shape.expert_ffn_size(cfg), norm_topk_prob=cfg.moe_router_norm_topk_prob,
                  decoder_sparse_step=1, router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False,
                  mlp_only_layers=[i for i in range(cfg.num_layers) if not model_shape.is_moe_layer(cfg, i)])
