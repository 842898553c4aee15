"""Hugging Face mixture-of-experts families: ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``
(and the MoE blocks of ``Qwen3MoeForCausalLM``, whose other fields :mod:`.hf_qwen3` maps).

Their attention, norms, RoPE and embeddings are Llama's (:mod:`.hf` maps those); this module maps
the config's MoE fields and the MoE blocks, in the per-expert layout transformers writes to disk:

* Mixtral (Jiang et al. 2024): ``block_sparse_moe.gate`` (router ``[E, h]``, softmax, top-k
  renormalised) and ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate/up/down).
* Qwen2-MoE (Qwen1.5-MoE / Qwen2-57B-A14B): ``mlp.gate``, ``mlp.experts.{e}.gate_proj/up_proj/
  down_proj``, a shared expert ``mlp.shared_expert.*`` scaled by ``sigmoid(mlp.shared_expert_gate
  (x))``; ``norm_topk_prob`` chooses renormalised or raw top-k probabilities; a bias on Q, K, V only.

paratron's expert tensors keep one logical name per expert (``layers.{i}.mlp.experts.{e}.gate|up|
fc2.weight``), so the mapping is a rename; the shared expert's gate and up are fused into the dense
MLP's ``fc1 = [gate; up]``.

DeepSeek-V3 models go to :mod:`.hf_deepseek` (checked first); other DeepSeek models (V2) are
refused with a clear error rather than imported wrongly.
"""

from __future__ import annotations

from dataclasses import replace
import torch

from paratron.config import ConfigError, ModelConfig, model_shape

from .hf_recipe import Recipe, cat_rows

Tensors = dict[str, torch.Tensor]
FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                 "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}  # Qwen3-MoE: see .hf_qwen3


def moe_family(hf: dict, where: str) -> str | None:
    """``"mixtral"``, ``"qwen2_moe"`` or None (not an MoE family) for a ``config.json`` dict.

    Raises:
        ConfigError: a DeepSeek model other than DeepSeek-V3.
    """
    kind = hf.get("model_type") or ""
    archs = hf.get("architectures") or []
    if kind.startswith("deepseek") or any(a.lower().startswith("deepseek") for a in archs):
        raise ConfigError(f"{where}: model_type={kind!r}: of the DeepSeek models (multi-head latent attention) "
                          "only DeepseekV3ForCausalLM converts; MoE import supports MixtralForCausalLM and "
                          "Qwen2MoeForCausalLM")
    for family, arch in FAMILIES.items():
        if kind == family or arch in archs:
            return family
    return None


def moe_config(base: ModelConfig, hf: dict, family: str, where: str) -> ModelConfig:
    """``base`` (the Llama-style fields) with the MoE fields of ``hf``.

    Raises:
        ConfigError: a feature paratron does not model (sliding-window attention, router jitter,
            dense layers between MoE layers), named with its field.
    """
    if hf.get("sliding_window") is not None and (family == "mixtral" or hf.get("use_sliding_window")):
        raise ConfigError(f"{where}: sliding_window={hf['sliding_window']}: sliding-window attention is not supported")
    if float(hf.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']}: paratron's router has no jitter")
    common = dict(num_experts=hf["num_local_experts" if family == "mixtral" else "num_experts"],
                  moe_top_k=hf["num_experts_per_tok"], moe_router_score="softmax",
                  moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)), moe_capacity_factor=None)
    if family == "mixtral":
        return replace(base, moe_ffn_hidden_size=hf["intermediate_size"], **common)
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError(f"{where}: decoder_sparse_step={hf.get('decoder_sparse_step')}, mlp_only_layers="
                          f"{hf.get('mlp_only_layers')}: only every layer being MoE is supported")
    shared = hf.get("shared_expert_intermediate_size") or 0
    if shared <= 0:
        raise ConfigError(f"{where}: shared_expert_intermediate_size={shared}: Qwen2-MoE needs a shared expert")
    return replace(base, moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_shared_expert_ffn_hidden_size=shared,
                   moe_shared_expert_gate=True, moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                   add_qkv_bias=bool(hf.get("qkv_bias", True)), **common)


def moe_recipes(cfg: ModelConfig, family: str, h: str, p: str) -> dict[str, Recipe]:
    """Layer ``p`` (``layers.{i}``)'s MoE tensors from Hugging Face layer ``h`` (``model.layers.{i}``)."""
    block = f"{h}.block_sparse_moe" if family == "mixtral" else f"{h}.mlp"
    out = {f"{p}.mlp.router.weight": Recipe((f"{block}.gate.weight",))}
    for e in range(cfg.num_experts):
        for ours, theirs in zip(("gate", "up", "fc2"), _EXPERT_NAMES[family]):
            out[f"{p}.mlp.experts.{e}.{ours}.weight"] = Recipe((f"{block}.experts.{e}.{theirs}.weight",))
    if cfg.moe_shared_expert_ffn_hidden_size:
        gate, up, down = (f"{block}.shared_expert.{n}.weight" for n in _EXPERT_NAMES["qwen2_moe"])
        out[f"{p}.mlp.shared_expert.fc1.weight"] = Recipe((gate, up), cat_rows)  # the fused [gate; up] of models.mlp
        out[f"{p}.mlp.shared_expert.fc2.weight"] = Recipe((down,))
        out[f"{p}.mlp.shared_expert_gate.weight"] = Recipe((f"{block}.shared_expert_gate.weight",))
    return out


def moe_export_problems(cfg: ModelConfig) -> list[str]:
    """What keeps an MoE model from every softmax-routed Hugging Face family (Mixtral, Qwen2-MoE,
    Qwen3-MoE), one entry per field; empty when nothing does."""
    rules = [(cfg.moe_router_score == "softmax", f"model.moe_router_score={cfg.moe_router_score!r} (softmax)"),
             (not cfg.add_bias_linear, "model.add_bias_linear=true (no MLP/output biases)"),
             (cfg.moe_capacity_factor is None, "model.moe_capacity_factor set (dropless only)"),
             (not cfg.moe_router_enable_expert_bias and cfg.moe_router_num_groups is None,
              "expert bias / group-limited routing"),
             (cfg.moe_router_topk_scaling_factor is None, "model.moe_router_topk_scaling_factor set (none)"),
             (cfg.activation == "swiglu" and cfg.normalization == "rmsnorm" and cfg.position_embedding_type == "rope",
              "Llama-style blocks (swiglu, rmsnorm, rope)")]
    return [why for ok, why in rules if not ok]


def export_family(cfg: ModelConfig) -> str:
    """The Hugging Face MoE family without QK-norm (Mixtral, Qwen2-MoE) that computes exactly
    this model.

    Raises:
        ConfigError: no family matches; the message names the fields.
    """
    broken = moe_export_problems(cfg)
    if cfg.moe_layer_freq != 1 or cfg.first_k_dense_replace:
        broken.append(f"model.moe_layer_freq={cfg.moe_layer_freq}, model.first_k_dense_replace="
                      f"{cfg.first_k_dense_replace} (every layer MoE)")
    if broken:
        raise ConfigError(f"MoE export needs: {'; '.join(broken)}")
    if cfg.moe_shared_expert_ffn_hidden_size and cfg.moe_shared_expert_gate:
        return "qwen2_moe"
    qkv = model_shape.qkv_bias(cfg)
    if not cfg.moe_shared_expert_ffn_hidden_size and cfg.moe_router_norm_topk_prob and not qkv:
        return "mixtral"
    raise ConfigError("MoE export: Mixtral needs no shared expert, renormalised top-k and no QKV bias; "
                      "Qwen2-MoE needs a gated shared expert (model.moe_shared_expert_gate)")


def export_moe(cfg: ModelConfig, family: str, hf: dict, t: Tensors, h: str, p: str) -> Tensors:
    """Layer ``p``'s MoE tensors under Hugging Face names (inverse of :func:`moe_recipes`), and
    the family's config fields written into ``hf`` (the Llama-style dict)."""
    block = f"{h}.block_sparse_moe" if family == "mixtral" else f"{h}.mlp"
    if family in ("mixtral", "qwen2_moe"):  # Qwen3-MoE writes its fields in .hf_qwen3.export_config
        hf.update(architectures=[FAMILIES[family]], model_type=family, num_experts_per_tok=cfg.moe_top_k,
                  router_aux_loss_coef=cfg.moe_aux_loss_coeff, output_router_logits=False)
    if family == "mixtral":
        hf.update(num_local_experts=cfg.num_experts, intermediate_size=t[f"{p}.mlp.experts.0.gate.weight"].shape[0],
                  sliding_window=None, router_jitter_noise=0.0)
    elif family == "qwen2_moe":
        hf.update(num_experts=cfg.num_experts, moe_intermediate_size=t[f"{p}.mlp.experts.0.gate.weight"].shape[0],
                  shared_expert_intermediate_size=cfg.moe_shared_expert_ffn_hidden_size, decoder_sparse_step=1,
                  mlp_only_layers=[], norm_topk_prob=cfg.moe_router_norm_topk_prob, use_sliding_window=False,
                  qkv_bias=model_shape.qkv_bias(cfg))
    out = {f"{block}.gate.weight": t[f"{p}.mlp.router.weight"]}
    for e in range(cfg.num_experts):
        for ours, theirs in zip(("gate", "up", "fc2"), _EXPERT_NAMES[family]):
            out[f"{block}.experts.{e}.{theirs}.weight"] = t[f"{p}.mlp.experts.{e}.{ours}.weight"]
    if family == "qwen2_moe":
        gate, up = t[f"{p}.mlp.shared_expert.fc1.weight"].chunk(2)
        out.update({f"{block}.shared_expert.gate_proj.weight": gate, f"{block}.shared_expert.up_proj.weight": up,
                    f"{block}.shared_expert.down_proj.weight": t[f"{p}.mlp.shared_expert.fc2.weight"],
                    f"{block}.shared_expert_gate.weight": t[f"{p}.mlp.shared_expert_gate.weight"]})
    return out
