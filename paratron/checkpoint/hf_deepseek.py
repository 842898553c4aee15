"""Hugging Face ``DeepseekV3ForCausalLM`` import and export: multi-head latent attention
(:mod:`paratron.models.mla`), dense SwiGLU MLPs in the first ``first_k_dense_replace`` layers and
DeepSeek-V3 MoE layers after them (sigmoid router with the score-correction bias, group-limited
top-k, normalised and scaled weights, shared experts; :mod:`paratron.models.moe.router`).

Name mapping per layer ``i`` (Hugging Face ``model.layers.{i}.self_attn.*`` -> paratron
``layers.{i}.attention.*``): ``q_a_proj`` -> ``q_down``, ``q_a_layernorm`` -> ``q_norm``,
``q_b_proj`` -> ``q_up`` (or ``q_proj`` -> ``q_proj`` without query compression),
``kv_a_proj_with_mqa`` -> ``kv_down``, ``kv_a_layernorm`` -> ``kv_norm``, ``kv_b_proj`` ->
``kv_up``, ``o_proj`` -> ``proj``; the norms, embeddings and dense MLPs as for Llama (:mod:`.hf`).
The per-head layouts agree (q: ``[nope; rope]`` per head; ``kv_b``: ``[k_nope; v]`` per head;
``kv_a``: ``[latent; rope key]``). MoE layers (``model.layers.{i}.mlp.*`` -> ``layers.{i}.mlp.*``):
``gate.weight`` -> ``router.weight``, ``gate.e_score_correction_bias`` -> ``router.expert_bias``,
``experts.{e}.gate_proj/up_proj/down_proj`` -> ``experts.{e}.gate/up/fc2``, and the shared
experts (``n_shared_experts`` of width ``moe_intermediate_size``, one MLP of the summed width)
``shared_experts.*`` -> ``shared_expert.fc1`` (``[gate; up]``) / ``fc2``.

RoPE layout: with ``rope_interleave = true`` (the default, and DeepSeek's released weights)
Hugging Face rotates interleaved pairs ``(x0, x1), (x2, x3), ...``; paratron rotates halves
(:mod:`paratron.models.rope`). Rotating the pairs equals rotating the halves of the
de-interleaved vector ``[x0, x2, ...; x1, x3, ...]``, and q . k is unchanged when both are
permuted alike, so import reorders the RoPE rows of ``q_b_proj`` (each head's last
``qk_rope_head_dim`` rows) and ``kv_a_proj_with_mqa`` (its last ``qk_rope_head_dim`` rows) to
that order, and export puts them back.

Not mapped (refused, naming the field): ``rms_norm_eps`` other than 1e-6 (transformers
normalises the latents with eps 1e-6 whatever the field says), YaRN RoPE scaling, attention
biases. Hugging Face's ``DeepseekV3ForCausalLM`` has no multi-token-prediction
modules (it skips ``model.layers.61``), so paratron's MTP modules are not exported and an
imported model has none (``model.mtp_num_layers`` may be set before training: they are then
drawn fresh).
"""

from __future__ import annotations

from functools import partial

import torch

from paratron.config import ConfigError, ModelConfig, model_shape

from .hf_recipe import Recipe, cat_rows

Tensors = dict[str, torch.Tensor]

ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6
"""The eps of transformers' ``q_a_layernorm`` / ``kv_a_layernorm`` (their constructor default)."""
_ATTENTION = (("q_a_proj", "q_down"), ("q_a_layernorm", "q_norm"), ("q_b_proj", "q_up"), ("q_proj", "q_proj"),
              ("kv_a_proj_with_mqa", "kv_down"), ("kv_a_layernorm", "kv_norm"), ("kv_b_proj", "kv_up"),
              ("o_proj", "proj"))


def is_deepseek_v3(hf: dict) -> bool:
    """Whether a ``config.json`` dict is a DeepSeek-V3 model."""
    return hf.get("model_type") == "deepseek_v3" or ARCHITECTURE in (hf.get("architectures") or [])


def deepseek_config(hf: dict, where: str) -> ModelConfig:
    """The :class:`ModelConfig` of a DeepSeek-V3 ``config.json`` dict.

    Raises:
        ConfigError: YaRN (or other) RoPE scaling, attention biases, an activation
            other than SiLU, or ``rms_norm_eps`` other than :data:`LATENT_NORM_EPS`, named with the
            field.
    """
    layers = hf["num_hidden_layers"]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} (rope_scaling) is not "
                          "supported (only the default RoPE)")
    if hf.get("attention_bias", False):
        raise ConfigError(f"{where}: attention_bias=true: paratron's MLA projections have no bias")
    eps = float(hf.get("rms_norm_eps", 1e-6))
    if eps != LATENT_NORM_EPS:
        raise ConfigError(f"{where}: rms_norm_eps={eps}: transformers' DeepSeek-V3 normalises the MLA latents with "
                          f"eps={LATENT_NORM_EPS} whatever this field says, paratron with model.norm_epsilon; "
                          "only rms_norm_eps=1e-6 (DeepSeek's own value) converts exactly")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU)")
    max_pos = hf.get("max_position_embeddings", 4096)
    return ModelConfig(
        num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"], seq_length=max_pos,
        max_position_embeddings=max_pos, normalization="rmsnorm", norm_epsilon=eps,
        position_embedding_type="rope", rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        activation="swiglu", add_bias_linear=False, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)), init_method_std=float(hf.get("initializer_range", 0.02)),
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        **_moe_fields(hf))


def _moe_fields(hf: dict) -> dict:
    """The MoE fields of :class:`ModelConfig` (none when every layer is dense)."""
    dense = min(hf.get("first_k_dense_replace", 0), hf["num_hidden_layers"])
    if not hf.get("n_routed_experts") or dense == hf["num_hidden_layers"]:
        return {}
    width, shared, groups = hf["moe_intermediate_size"], hf.get("n_shared_experts") or 0, hf.get("n_group") or 1
    return dict(num_experts=hf["n_routed_experts"], moe_top_k=hf["num_experts_per_tok"], moe_ffn_hidden_size=width,
                moe_router_score="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                moe_router_norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=hf.get("topk_group") if groups > 1 else None,
                moe_shared_expert_ffn_hidden_size=shared * width or None, first_k_dense_replace=dense,
                moe_capacity_factor=None, moe_aux_loss_coeff=0.0)


def _rope_order(d: int, inverse: bool) -> torch.Tensor:
    """Row order taking interleaved RoPE pairs to halves (``inverse``: back)."""
    order = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return torch.argsort(order) if inverse else order


def _reorder_rope_rows(w: torch.Tensor, cfg: ModelConfig, heads: int, inverse: bool) -> torch.Tensor:
    """Reorder the RoPE rows of ``w`` (``heads`` blocks of ``[nope or latent; rope]`` rows)."""
    d = cfg.qk_pos_emb_head_dim
    blocks = w.reshape(heads, -1, *w.shape[1:])
    rope = blocks[:, -d:][:, _rope_order(d, inverse)]
    return torch.cat([blocks[:, :-d], rope], dim=1).reshape(w.shape).contiguous()


def _permute_attention(cfg: ModelConfig, t: Tensors, p: str, inverse: bool) -> None:
    q = f"{p}.attention.q_up.weight" if cfg.q_lora_rank is not None else f"{p}.attention.q_proj.weight"
    t[q] = _reorder_rope_rows(t[q], cfg, cfg.num_attention_heads, inverse)
    kv = f"{p}.attention.kv_down.weight"
    t[kv] = _reorder_rope_rows(t[kv], cfg, 1, inverse)


def _attention_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    skip = ("q_proj",) if cfg.q_lora_rank is not None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    return [(theirs, ours) for theirs, ours in _ATTENTION if theirs not in skip]


def _layer_names(cfg: ModelConfig, i: int) -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """Layer ``i``'s (Hugging Face name, paratron name) renames, and its fused SwiGLU inputs
    (paratron ``fc1``, Hugging Face gate, Hugging Face up)."""
    h, p = f"model.layers.{i}", f"layers.{i}"
    names = [(f"{h}.input_layernorm.weight", f"{p}.input_norm.weight"),
             (f"{h}.post_attention_layernorm.weight", f"{p}.post_attention_norm.weight")]
    names += [(f"{h}.self_attn.{a}.weight", f"{p}.attention.{b}.weight") for a, b in _attention_names(cfg)]
    hm, pm = f"{h}.mlp", f"{p}.mlp"
    if not model_shape.is_moe_layer(cfg, i):
        return names + [(f"{hm}.down_proj.weight", f"{pm}.fc2.weight")], [_fused(f"{pm}.fc1", hm)]
    names += [(f"{hm}.gate.weight", f"{pm}.router.weight"),
              (f"{hm}.gate.e_score_correction_bias", f"{pm}.router.expert_bias")]
    for e in range(cfg.num_experts):
        names += [(f"{hm}.experts.{e}.{a}.weight", f"{pm}.experts.{e}.{b}.weight")
                  for a, b in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "fc2"))]
    if not cfg.moe_shared_expert_ffn_hidden_size:
        return names, []
    names.append((f"{hm}.shared_experts.down_proj.weight", f"{pm}.shared_expert.fc2.weight"))
    return names, [_fused(f"{pm}.shared_expert.fc1", f"{hm}.shared_experts")]


def _fused(ours: str, theirs: str) -> tuple[str, str, str]:
    return f"{ours}.weight", f"{theirs}.gate_proj.weight", f"{theirs}.up_proj.weight"


def _rope_rows_to_halves(parts: list[torch.Tensor], cfg: ModelConfig, heads: int) -> torch.Tensor:
    return _reorder_rope_rows(parts[0], cfg, heads, inverse=False)


def deepseek_recipes(cfg: ModelConfig, hf: dict) -> dict[str, Recipe]:
    """``{paratron name: Recipe}`` of a DeepSeek-V3 checkpoint (:mod:`.hf_recipe`): renames, the
    fused ``[gate; up]``, and with ``rope_interleave`` the RoPE rows of the query up-projection and
    ``kv_down`` reordered to halves (a row permutation, so it slices like the rest)."""
    out = {"embedding.word_embeddings.weight": Recipe(("model.embed_tokens.weight",)),
           "final_norm.weight": Recipe(("model.norm.weight",))}
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = Recipe(("lm_head.weight",))
    for i in range(cfg.num_layers):
        names, fused = _layer_names(cfg, i)
        out.update({ours: Recipe((theirs,)) for theirs, ours in names})
        out.update({fc1: Recipe((gate, up), cat_rows) for fc1, gate, up in fused})
        if hf.get("rope_interleave", True):
            p = f"layers.{i}.attention"
            q = f"{p}.q_up.weight" if cfg.q_lora_rank is not None else f"{p}.q_proj.weight"
            for name, heads in ((q, cfg.num_attention_heads), (f"{p}.kv_down.weight", 1)):
                out[name] = Recipe(out[name].sources, partial(_rope_rows_to_halves, cfg=cfg, heads=heads))
    return out


def deepseek_export(cfg: ModelConfig, t: Tensors) -> tuple[dict, Tensors]:
    """``(config.json dict, Hugging Face tensors)`` of an MLA model with dense SwiGLU MLPs and
    DeepSeek-V3 MoE layers (``rope_interleave = true``, as DeepSeek ships it). MTP modules are
    left out.

    Raises:
        ConfigError: the model is not an MLA / RMSNorm / SwiGLU model without biases, or its MoE
            layers are not DeepSeek-V3's (each reason named).
    """
    broken = _moe_export_problems(cfg) if cfg.num_experts else []
    if not cfg.multi_latent_attention or cfg.add_bias_linear or \
            (cfg.normalization, cfg.activation, cfg.norm_epsilon) != ("rmsnorm", "swiglu", LATENT_NORM_EPS):
        broken.append(f"model.multi_latent_attention=true with rmsnorm, swiglu, model.norm_epsilon={LATENT_NORM_EPS} "
                      "and no biases")
    if broken:
        raise ConfigError(f"DeepseekV3ForCausalLM export needs: {'; '.join(broken)}")
    hf = {"architectures": [ARCHITECTURE], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": model_shape.ffn_size(cfg),
          "num_hidden_layers": cfg.num_layers, **_moe_export_fields(cfg),
          "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
          "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
          "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
          "head_dim": cfg.qk_pos_emb_head_dim, "rope_interleave": True, "hidden_act": "silu",
          "max_position_embeddings": model_shape.max_positions(cfg), "rms_norm_eps": cfg.norm_epsilon,
          "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
          "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std}
    t = dict(t)
    out = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"], "model.norm.weight": t["final_norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = t["output_layer.weight"]
    for i in range(cfg.num_layers):
        _permute_attention(cfg, t, f"layers.{i}", inverse=True)
        names, fused = _layer_names(cfg, i)
        out.update({theirs: t[ours] for theirs, ours in names})
        for fc1, gate, up in fused:
            out[gate], out[up] = t[fc1].chunk(2)
    return hf, out


def _moe_export_problems(cfg: ModelConfig) -> list[str]:
    width, shared = model_shape.expert_ffn_size(cfg), cfg.moe_shared_expert_ffn_hidden_size
    rules = [(cfg.moe_router_score == "sigmoid", f"model.moe_router_score={cfg.moe_router_score!r} (sigmoid)"),
             (cfg.moe_router_enable_expert_bias, "model.moe_router_enable_expert_bias=true"),
             (cfg.moe_capacity_factor is None, "model.moe_capacity_factor unset (dropless)"),
             (cfg.moe_layer_freq == 1, f"model.moe_layer_freq={cfg.moe_layer_freq} (1)"),
             (not cfg.moe_shared_expert_gate, "no shared-expert gate"),
             (not shared or shared % width == 0, f"a shared-expert width (now {shared}) that is a multiple of {width}")]
    return [why for ok, why in rules if not ok]


def _moe_export_fields(cfg: ModelConfig) -> dict:
    if not cfg.num_experts:
        return {"first_k_dense_replace": cfg.num_layers}
    width, groups = model_shape.expert_ffn_size(cfg), cfg.moe_router_num_groups
    return {"first_k_dense_replace": cfg.first_k_dense_replace, "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": width,
            "n_shared_experts": (cfg.moe_shared_expert_ffn_hidden_size or 0) // width,
            "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
            "norm_topk_prob": cfg.moe_router_norm_topk_prob, "n_group": groups or 1,
            "topk_group": cfg.moe_router_group_topk or 1}
