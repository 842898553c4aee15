"""Hugging Face import and export for ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` folders
(``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``), and
through :mod:`.hf_moe` the MoE families ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM``
(Llama blocks with MoE MLPs), through :mod:`.hf_qwen3` ``Qwen3ForCausalLM`` and
``Qwen3MoeForCausalLM`` (Llama blocks with QK-norm; MoE MLPs), and through :mod:`.hf_deepseek`
``DeepseekV3ForCausalLM`` (multi-head latent attention).

Both directions work on *full* logical tensors keyed by paratron's layout-independent names
(``layers.3.attention.qkv.weight``, ...), so an imported model loads into any TP/PP layout with
:func:`paratron.models.gpt.load_full_state` (which calls ``params.load_full_`` per parameter),
and any layout exports after gathering full tensors. The import is a table of
:class:`~.hf_recipe.Recipe` (:func:`hf_recipes`), which :mod:`.hf_load` also follows to read only
a rank's slices.

Layout differences handled here:

* **Fused QKV.** paratron fuses Q, K, V in one weight ordered per KV group ``[q heads of the
  group, k, v]`` (see :mod:`paratron.models.attention`); Llama keeps ``q_proj``/``k_proj``/
  ``v_proj``, GPT-2 one ``c_attn`` ordered ``[Q; K; V]``.
* **GPT-2 Conv1D.** GPT-2 stores linear weights as ``[in, out]``; paratron as ``[out, in]``.
* **RoPE.** paratron uses the same half-split rotation as the Hugging Face Llama port
  (:mod:`paratron.models.rope`), so q/k weights need no permutation.
* **Vocabulary padding** is not part of a logical tensor: nothing to strip or add.

transformers itself is not needed: config.json is read and written as JSON.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import torch

from paratron.config import ConfigError, ModelConfig, model_shape

from . import hf_qwen3
from .hf_recipe import Recipe, cat_rows
from .hf_deepseek import deepseek_config, deepseek_export, deepseek_recipes, is_deepseek_v3
from .hf_moe import export_family, export_moe, moe_config, moe_family, moe_recipes

Tensors = dict[str, torch.Tensor]
Recipes = dict[str, Recipe]

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                     "gelu": "gelu"}
# Non-parameter buffers some checkpoints carry (GPT-2's causal mask, old rotary caches).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


# ------------------------------------------------------------------------------------------
# QKV fusion
# ------------------------------------------------------------------------------------------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """``q`` ``[n*d, ...]``, ``k``/``v`` ``[g*d, ...]`` -> paratron's fused ``[(n + 2g)*d, ...]``
    ordered per KV group: ``[q heads of group j, k_j, v_j]`` for j = 0..g-1."""
    d = q.shape[0] // heads
    rest = tuple(q.shape[1:])
    qg = q.reshape(groups, heads // groups, d, *rest)
    kg, vg = k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)
    return torch.cat((qg, kg, vg), dim=1).reshape((heads + 2 * groups) * d, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: returns ``(q [n*d, ...], k [g*d, ...], v [g*d, ...])``."""
    d = qkv.shape[0] // (heads + 2 * groups)
    rest = tuple(qkv.shape[1:])
    per = qkv.reshape(groups, heads // groups + 2, d, *rest)
    q = per[:, :heads // groups].reshape(heads * d, *rest)
    return q.contiguous(), per[:, -2].reshape(groups * d, *rest).contiguous(), \
        per[:, -1].reshape(groups * d, *rest).contiguous()


# ------------------------------------------------------------------------------------------
# Reading a Hugging Face folder
# ------------------------------------------------------------------------------------------
def _read_safetensors(hf_dir: Path) -> Tensors:
    from safetensors.torch import load_file

    single = hf_dir / "model.safetensors"
    index = hf_dir / "model.safetensors.index.json"
    if single.is_file():
        return load_file(str(single))
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: Tensors = {}
        for f in files:
            out.update(load_file(str(hf_dir / f)))
        return out
    raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json "
                            "(only safetensors checkpoints are supported)")


def _architecture(hf: dict, where: str) -> str:
    kind = hf.get("model_type")
    archs = hf.get("architectures") or []
    if is_deepseek_v3(hf):
        return "deepseek_v3"
    family = hf_qwen3.qwen3_family(hf) or moe_family(hf, where)
    if family is not None:
        return family
    if kind == "llama" or "LlamaForCausalLM" in archs:
        return "llama"
    if kind == "gpt2" or "GPT2LMHeadModel" in archs:
        return "gpt2"
    raise ConfigError(f"{where}: model_type={kind!r}, architectures={archs}: supported: LlamaForCausalLM, "
                      "GPT2LMHeadModel, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, "
                      "Qwen3MoeForCausalLM")


def _llama_config(hf: dict, where: str) -> ModelConfig:
    heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    # An explicit head_dim (Qwen3: 128 at h=1024 with 16 heads) is model.kv_channels.
    head_dim = hf.get("head_dim")
    kv_channels = None if head_dim is None or (head_dim * heads == hidden) else int(head_dim)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r}; Llama import supports 'silu' (SwiGLU)")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        raise ConfigError(f"{where}: attention_bias={hf.get('attention_bias')} and mlp_bias={hf.get('mlp_bias')} "
                          "differ; paratron has one switch, model.add_bias_linear")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                          "(only the default RoPE)")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    max_pos = hf.get("max_position_embeddings", 2048)
    return ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads, kv_channels=kv_channels,
        ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=max_pos, max_position_embeddings=max_pos,
        normalization="rmsnorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        position_embedding_type="rope", rope_theta=float(theta), activation="swiglu",
        add_bias_linear=bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=float(hf.get("initializer_range", 0.02)))


def _gpt2_config(hf: dict, where: str) -> ModelConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTIVATIONS:
        raise ConfigError(f"{where}: activation_function={act!r}; supported: {sorted(_GPT2_ACTIVATIONS)}")
    if hf.get("scale_attn_by_inverse_layer_idx", False) or not hf.get("scale_attn_weights", True):
        raise ConfigError(f"{where}: scale_attn_by_inverse_layer_idx / scale_attn_weights=false change the "
                          "attention scale; paratron uses 1/sqrt(head_dim)")
    if hf.get("add_cross_attention", False):
        raise ConfigError(f"{where}: add_cross_attention=true is not supported")
    max_pos = hf.get("n_positions", hf.get("max_position_embeddings", 1024))
    return ModelConfig(
        num_layers=hf["n_layer"], hidden_size=hf["n_embd"], num_attention_heads=hf["n_head"],
        num_query_groups=None, ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
        vocab_size=hf["vocab_size"], seq_length=max_pos, max_position_embeddings=max_pos,
        normalization="layernorm", norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        position_embedding_type="learned", activation=_GPT2_ACTIVATIONS[act], add_bias_linear=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_dropout=float(hf.get("resid_pdrop", 0.1)), attention_dropout=float(hf.get("attn_pdrop", 0.1)),
        init_method_std=float(hf.get("initializer_range", 0.02)))


def _kinds(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _fused_qkv(parts: list[torch.Tensor], heads: int, groups: int) -> torch.Tensor:
    return fuse_qkv(*parts, heads, groups)


def _gpt2_qkv(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    return fuse_qkv(*parts[0].chunk(3, dim=0), heads, heads)  # c_attn is [Q; K; V]


def _llama_recipes(cfg: ModelConfig, family: str = "llama") -> Recipes:
    heads, groups = cfg.num_attention_heads, model_shape.query_groups(cfg)
    out: Recipes = {"embedding.word_embeddings.weight": Recipe(("model.embed_tokens.weight",)),
                    "final_norm.weight": Recipe(("model.norm.weight",))}
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = Recipe(("lm_head.weight",))
    for i in range(cfg.num_layers):
        h, p = f"model.layers.{i}", f"layers.{i}"
        out[f"{p}.input_norm.weight"] = Recipe((f"{h}.input_layernorm.weight",))
        out[f"{p}.post_attention_norm.weight"] = Recipe((f"{h}.post_attention_layernorm.weight",))
        for kind in _kinds(model_shape.qkv_bias(cfg)):
            out[f"{p}.attention.qkv.{kind}"] = Recipe(tuple(f"{h}.self_attn.{x}_proj.{kind}" for x in "qkv"),
                                                      partial(_fused_qkv, heads=heads, groups=groups))
        for kind in _kinds(cfg.add_bias_linear):
            out[f"{p}.attention.proj.{kind}"] = Recipe((f"{h}.self_attn.o_proj.{kind}",))
        if cfg.qk_layernorm:
            out.update(hf_qwen3.qk_norm_recipes(cfg, h, p))
        if model_shape.is_moe_layer(cfg, i):
            out.update(moe_recipes(cfg, family, h, p))
            continue
        for kind in _kinds(cfg.add_bias_linear):  # fc1 is the fused [gate; up] of models.mlp
            out[f"{p}.mlp.fc1.{kind}"] = Recipe((f"{h}.mlp.gate_proj.{kind}", f"{h}.mlp.up_proj.{kind}"), cat_rows)
            out[f"{p}.mlp.fc2.{kind}"] = Recipe((f"{h}.mlp.down_proj.{kind}",))
    return out


def _gpt2_recipes(cfg: ModelConfig) -> Recipes:
    """GPT-2's names without the ``transformer.`` prefix that GPT2LMHeadModel saves with."""
    heads = cfg.num_attention_heads
    out: Recipes = {"embedding.word_embeddings.weight": Recipe(("wte.weight",)),
                    "embedding.position_embeddings.weight": Recipe(("wpe.weight",)),
                    "final_norm.weight": Recipe(("ln_f.weight",)), "final_norm.bias": Recipe(("ln_f.bias",))}
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = Recipe(("lm_head.weight",))
    for i in range(cfg.num_layers):
        h, p = f"h.{i}", f"layers.{i}"
        for ours, theirs in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
            for kind in ("weight", "bias"):
                out[f"{p}.{ours}.{kind}"] = Recipe((f"{h}.{theirs}.{kind}",))
        # Conv1D weights are [in, out]: transposed to [out, in].
        out[f"{p}.attention.qkv.weight"] = Recipe((f"{h}.attn.c_attn.weight",), partial(_gpt2_qkv, heads=heads),
                                                  transposed=True)
        out[f"{p}.attention.qkv.bias"] = Recipe((f"{h}.attn.c_attn.bias",), partial(_gpt2_qkv, heads=heads))
        for ours, theirs in (("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[f"{p}.{ours}.weight"] = Recipe((f"{h}.{theirs}.weight",), transposed=True)
            out[f"{p}.{ours}.bias"] = Recipe((f"{h}.{theirs}.bias",))
    return out


def hf_recipes(cfg: ModelConfig, hf: dict, where: str = "config.json") -> Recipes:
    """``{paratron logical name: Recipe}`` for the model of a ``config.json`` dict (``cfg`` is
    :func:`hf_config_to_model`'s result, possibly with overrides that do not change weights). The
    one name/layout mapping of the import: :func:`hf_to_paratron` builds full tensors from it and
    :mod:`.hf_load` reads each rank's slices with it. GPT-2's source names carry no
    ``transformer.`` prefix (:func:`source_names` resolves either spelling)."""
    arch = _architecture(hf, where)
    if arch == "deepseek_v3":
        return deepseek_recipes(cfg, hf)
    return _gpt2_recipes(cfg) if arch == "gpt2" else _llama_recipes(cfg, arch)


def source_names(hf: dict, names, where: str = "config.json") -> dict[str, str]:
    """``{name a recipe uses: name in the checkpoint}`` for the checkpoint's tensor ``names``
    (GPT2LMHeadModel saves with a ``transformer.`` prefix, the original GPT-2 files without one)."""
    if _architecture(hf, where) != "gpt2":
        return {n: n for n in names}
    return {n.removeprefix("transformer."): n for n in names}


def unmapped_sources(cfg: ModelConfig, recipes: Recipes, names) -> list[str]:
    """Checkpoint tensor names (as :func:`source_names` keys) no recipe reads, buffers and a tied
    model's ``lm_head.weight`` excepted, sorted."""
    used = {s for r in recipes.values() for s in r.sources}
    if cfg.tie_embeddings:
        used.add("lm_head.weight")
    return sorted(n for n in names if n not in used and not n.endswith(_IGNORED_SUFFIXES))


def hf_config_to_model(hf: dict, where: str = "config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dict (Llama, GPT-2, Mixtral,
    Qwen2-MoE, Qwen3, Qwen3-MoE).

    Raises:
        ConfigError: another architecture, or a feature paratron does not model (named).
    """
    arch = _architecture(hf, where)
    if arch == "gpt2":
        return _gpt2_config(hf, where)
    if arch == "deepseek_v3":
        return deepseek_config(hf, where)
    cfg = _llama_config(hf, where)
    if arch == "llama":
        return cfg
    if arch in hf_qwen3.FAMILIES:
        return hf_qwen3.qwen3_config(cfg, hf, arch, where)

    return moe_config(cfg, hf, arch, where)


def hf_to_paratron(hf_dir: str | Path) -> tuple[ModelConfig, Tensors]:
    """Read a Hugging Face ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``MixtralForCausalLM``,
    ``Qwen2MoeForCausalLM``, ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` folder.

    Returns:
        ``(model config, {logical name: full tensor})``, tensors in the checkpoint's dtype.
    Raises:
        FileNotFoundError: no config.json or safetensors file.
        ConfigError: an unsupported architecture or feature (named).
        KeyError: a tensor the config calls for is missing.
        ValueError: the checkpoint holds tensors this mapping does not know (named), or a QK-norm
            weight is not ``head_dim`` wide.
    """
    hf_dir = Path(hf_dir)
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json")
    hf = json.loads(cfg_path.read_text())
    cfg = hf_config_to_model(hf, str(cfg_path))
    where = str(hf_dir)
    src = _read_safetensors(hf_dir)
    src = {ours: src[theirs] for ours, theirs in source_names(hf, list(src), where).items()}
    recipes = hf_recipes(cfg, hf, where)
    left = unmapped_sources(cfg, recipes, src)
    if left:
        raise ValueError(f"{where}: tensors not mapped to paratron names: {left[:8]}"
                         f"{' ...' if len(left) > 8 else ''}")

    def read(name: str) -> torch.Tensor:
        if name not in src:
            raise KeyError(f"{where}: tensor {name!r} is missing from the checkpoint")
        return src[name]

    return cfg, {name: r.build(read) for name, r in recipes.items()}


# ------------------------------------------------------------------------------------------
# Writing a Hugging Face folder
# ------------------------------------------------------------------------------------------
def hf_architecture_for(cfg: ModelConfig) -> str:
    """``"llama"``, ``"gpt2"``, ``"mixtral"``, ``"qwen2_moe"``, ``"qwen3"`` or ``"qwen3_moe"``: the
    Hugging Face architecture that computes exactly this model (QK-norm: a Qwen3 family).

    Raises:
        ConfigError: no supported architecture matches; the message names the fields.
    """
    if cfg.multi_latent_attention:
        return "deepseek_v3"  # hf_deepseek.deepseek_export checks the rest
    if cfg.qk_layernorm:
        return hf_qwen3.export_family(cfg)
    if cfg.num_experts > 0:
        return export_family(cfg)
    if cfg.add_qkv_bias is not None and cfg.add_qkv_bias != cfg.add_bias_linear:
        raise ConfigError(f"model.add_qkv_bias={cfg.add_qkv_bias} differs from model.add_bias_linear: "
                          "no dense export target")
    if (cfg.normalization, cfg.position_embedding_type, cfg.activation) == ("rmsnorm", "rope", "swiglu"):
        return "llama"
    if (cfg.normalization, cfg.position_embedding_type) == ("layernorm", "learned") and \
            cfg.activation in ("gelu", "gelu_tanh"):
        if not cfg.add_bias_linear:
            raise ConfigError("model.add_bias_linear=false: GPT-2 always has biases; no export target")
        if model_shape.query_groups(cfg) != cfg.num_attention_heads:
            raise ConfigError(f"model.num_query_groups={cfg.num_query_groups}: GPT-2 has no grouped-query "
                              "attention; no export target")
        return "gpt2"
    raise ConfigError(f"model.normalization={cfg.normalization!r}, model.position_embedding_type="
                      f"{cfg.position_embedding_type!r}, model.activation={cfg.activation!r}: export "
                      "supports Llama (rmsnorm, rope, swiglu) and GPT-2 (layernorm, learned, gelu/gelu_tanh)")


def _dtype_name(tensors: Tensors) -> str:
    dt = next(iter(tensors.values())).dtype
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dt, "float32")


def _llama_export(cfg: ModelConfig, t: Tensors, family: str = "llama") -> tuple[dict, Tensors]:
    heads, groups = cfg.num_attention_heads, model_shape.query_groups(cfg)
    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": model_shape.ffn_size(cfg),
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": heads, "num_key_value_heads": groups,
          "head_dim": model_shape.head_dim(cfg), "hidden_act": "silu",
          "max_position_embeddings": model_shape.max_positions(cfg), "rms_norm_eps": cfg.norm_epsilon,
          "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
          "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.add_bias_linear,
          "mlp_bias": cfg.add_bias_linear, "attention_dropout": cfg.attention_dropout,
          "initializer_range": cfg.init_method_std}
    if family in hf_qwen3.FAMILIES:
        hf_qwen3.export_config(cfg, hf, family)
    out = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"], "model.norm.weight": t["final_norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = t["output_layer.weight"]
    for i in range(cfg.num_layers):
        h, p = f"model.layers.{i}", f"layers.{i}"
        out[f"{h}.input_layernorm.weight"] = t[f"{p}.input_norm.weight"]
        out[f"{h}.post_attention_layernorm.weight"] = t[f"{p}.post_attention_norm.weight"]
        for kind in _kinds(model_shape.qkv_bias(cfg)):
            q, k, v = split_qkv(t[f"{p}.attention.qkv.{kind}"], heads, groups)
            out.update({f"{h}.self_attn.q_proj.{kind}": q, f"{h}.self_attn.k_proj.{kind}": k,
                        f"{h}.self_attn.v_proj.{kind}": v})
        for kind in _kinds(cfg.add_bias_linear):
            out[f"{h}.self_attn.o_proj.{kind}"] = t[f"{p}.attention.proj.{kind}"]
        if cfg.qk_layernorm:
            out.update(hf_qwen3.export_qk_norm(t, h, p))
        if model_shape.is_moe_layer(cfg, i):
            out.update(export_moe(cfg, family, hf, t, h, p))
            continue
        for kind in _kinds(cfg.add_bias_linear):
            gate, up = t[f"{p}.mlp.fc1.{kind}"].chunk(2)
            out.update({f"{h}.mlp.gate_proj.{kind}": gate, f"{h}.mlp.up_proj.{kind}": up,
                        f"{h}.mlp.down_proj.{kind}": t[f"{p}.mlp.fc2.{kind}"]})
    return hf, out


def _gpt2_export(cfg: ModelConfig, t: Tensors) -> tuple[dict, Tensors]:
    heads = cfg.num_attention_heads
    act = "gelu_new" if cfg.activation == "gelu_tanh" else "gelu"
    hf = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
          "n_positions": model_shape.max_positions(cfg), "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
          "n_head": heads, "n_inner": model_shape.ffn_size(cfg), "activation_function": act,
          "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
          "layer_norm_epsilon": cfg.norm_epsilon, "initializer_range": cfg.init_method_std,
          "tie_word_embeddings": cfg.tie_embeddings, "scale_attn_weights": True}
    out = {"transformer.wte.weight": t["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": t["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": t["final_norm.weight"], "transformer.ln_f.bias": t["final_norm.bias"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = t["output_layer.weight"]
    for i in range(cfg.num_layers):
        h, p = f"transformer.h.{i}", f"layers.{i}"
        for ours, theirs in (("input_norm", "ln_1"), ("post_attention_norm", "ln_2")):
            out[f"{h}.{theirs}.weight"] = t[f"{p}.{ours}.weight"]
            out[f"{h}.{theirs}.bias"] = t[f"{p}.{ours}.bias"]
        out[f"{h}.attn.c_attn.weight"] = torch.cat(split_qkv(t[f"{p}.attention.qkv.weight"], heads, heads)).t()
        out[f"{h}.attn.c_attn.bias"] = torch.cat(split_qkv(t[f"{p}.attention.qkv.bias"], heads, heads))
        for ours, theirs in (("attention.proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            out[f"{h}.{theirs}.weight"] = t[f"{p}.{ours}.weight"].t()
            out[f"{h}.{theirs}.bias"] = t[f"{p}.{ours}.bias"]
    return hf, out


def paratron_to_hf(cfg: ModelConfig, tensors: Tensors, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` that ``transformers`` loads as
    ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
    ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` (chosen by :func:`hf_architecture_for`).

    Args:
        cfg: the model config (``vocab_size`` set).
        tensors: ``{logical name: full tensor}`` (unpadded vocab), e.g. from
            :func:`paratron.models.gpt.gather_full_state` or a checkpoint.
        out_dir: created if missing.
    Returns: ``out_dir`` as a Path.
    Raises:
        ConfigError: no supported architecture matches the config.
        KeyError: a tensor the config calls for is missing (named).
    """
    from safetensors.torch import save_file

    arch = hf_architecture_for(cfg)
    try:
        if arch == "deepseek_v3":
            hf, out = deepseek_export(cfg, tensors)
        else:
            hf, out = _gpt2_export(cfg, tensors) if arch == "gpt2" else _llama_export(cfg, tensors, arch)
    except KeyError as e:
        raise KeyError(f"paratron_to_hf: tensor {e.args[0]!r} is missing") from None
    hf["dtype"] = hf["torch_dtype"] = _dtype_name(tensors)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # safetensors refuses views sharing storage: give every tensor its own contiguous copy.
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return out_dir
