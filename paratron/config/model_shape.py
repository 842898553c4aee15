"""Derived model sizes and the checks a model config must pass for a tensor-parallel size.

The model config leaves some sizes open (``num_query_groups``, ``ffn_hidden_size``,
``max_position_embeddings``); the functions here resolve them the same way everywhere (model
construction, the FLOPs formula, Hugging Face conversion), so that no two modules disagree.
"""

from __future__ import annotations

from .errors import ConfigError
from .sections import ModelConfig

LLAMA_FFN_MULTIPLE_OF = 256
"""Llama rounds its SwiGLU width 8h/3 up to a multiple of this (Touvron et al. 2023, code release)."""


def head_dim(cfg: ModelConfig) -> int:
    """Width of one attention head: ``kv_channels``, else ``hidden_size / num_attention_heads``."""
    return cfg.kv_channels if cfg.kv_channels is not None else cfg.hidden_size // cfg.num_attention_heads


def rope_dim(cfg: ModelConfig) -> int:
    """Width RoPE rotates per head: the decoupled RoPE part ``qk_pos_emb_head_dim`` under
    multi-head latent attention, else the whole head (:func:`head_dim`)."""
    return cfg.qk_pos_emb_head_dim if cfg.multi_latent_attention else head_dim(cfg)


def query_groups(cfg: ModelConfig) -> int:
    """KV groups: ``num_query_groups``, or ``num_attention_heads`` (multi-head) when unset."""
    return cfg.num_query_groups if cfg.num_query_groups is not None else cfg.num_attention_heads


def qkv_bias(cfg: ModelConfig) -> bool:
    """Whether the fused QKV projection has a bias: ``add_qkv_bias``, else ``add_bias_linear``."""
    return cfg.add_bias_linear if cfg.add_qkv_bias is None else cfg.add_qkv_bias


def ffn_size(cfg: ModelConfig) -> int:
    """MLP inner width: ``ffn_hidden_size``, else 4h (GELU) or Llama's 8h/3 rounded up to 256 (SwiGLU)."""
    if cfg.ffn_hidden_size is not None:
        return cfg.ffn_hidden_size
    if cfg.activation == "swiglu":
        m = LLAMA_FFN_MULTIPLE_OF
        return m * ((int(8 * cfg.hidden_size / 3) + m - 1) // m)
    return 4 * cfg.hidden_size


def expert_ffn_size(cfg: ModelConfig) -> int:
    """Inner width of one expert: ``moe_ffn_hidden_size``, else the dense MLP width."""
    return cfg.moe_ffn_hidden_size if cfg.moe_ffn_hidden_size is not None else ffn_size(cfg)


def max_positions(cfg: ModelConfig) -> int:
    """Rows of the learned position table: ``max_position_embeddings`` or ``seq_length``."""
    return cfg.max_position_embeddings or cfg.seq_length


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether global layer ``layer`` (0-based) holds an MoE MLP: ``layer >= first_k_dense_replace``
    and ``layer % moe_layer_freq == 0`` (the rule of DeepSeek-V3's Hugging Face port)."""
    return moe_at(layer, cfg.num_experts, cfg.moe_layer_freq, cfg.first_k_dense_replace)


def moe_at(layer: int, num_experts: int, freq: int, first_dense: int) -> bool:
    """:func:`is_moe_layer` on the bare sizes (the planner keeps them without the config)."""
    return num_experts > 0 and layer >= first_dense and layer % freq == 0


def moe_layer_fields(moe: list[bool]) -> tuple[int, int] | None:
    """``(first_k_dense_replace, moe_layer_freq)`` that make exactly the layers flagged in ``moe``
    (one flag per layer) MoE layers under :func:`is_moe_layer`, or None when no such pair exists."""
    n = len(moe)
    for first in range(n + 1):
        for freq in range(1, n + 1):
            if all(flag == moe_at(i, 1, freq, first) for i, flag in enumerate(moe)):
                return first, freq
    return None


def check_model(cfg: ModelConfig, tp: int) -> None:
    """Check a model config before building the model: a vocab size is set (the model
    constructors run this), and :func:`check_shape`.

    Raises:
        ConfigError: a missing vocab size, or a rule of :func:`check_shape`.
    """
    if cfg.vocab_size is None or cfg.vocab_size < 1:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} must be set to a positive integer "
                          "before building the model (take it from the tokenizer)")
    check_shape(cfg, tp)


LORA_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "proj": ("o_proj",), "fc1": ("gate_proj", "up_proj"),
                "fc2": ("down_proj",)}
"""``model.lora_targets`` names (paratron's linears) -> the Hugging Face / PEFT modules they
export to (Llama naming); the fused ``qkv`` and SwiGLU ``fc1`` map to several."""


def check_lora(cfg: ModelConfig) -> None:
    """The LoRA fields' rules (:mod:`paratron.models.lora`).

    Raises:
        ConfigError: a negative rank, a non-positive alpha, a dropout outside [0, 1), an empty or
            unknown target (a Hugging Face name gets the paratron module it is part of).
    """
    if cfg.lora_rank < 0:
        raise ConfigError(f"model.lora_rank={cfg.lora_rank} must be >= 0 (0: no LoRA)")
    if cfg.lora_rank == 0:
        return
    if not cfg.lora_alpha > 0:
        raise ConfigError(f"model.lora_alpha={cfg.lora_alpha} must be > 0 (the scale is lora_alpha / lora_rank)")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ConfigError(f"model.lora_dropout={cfg.lora_dropout} must be in [0, 1)")
    if not cfg.lora_targets:
        raise ConfigError(f"model.lora_targets is empty; choose from {sorted(LORA_TARGETS)}")
    hf = {h: name for name, hs in LORA_TARGETS.items() for h in hs}
    for t in cfg.lora_targets:
        if t in hf:
            raise ConfigError(f"model.lora_targets: {t!r} is a Hugging Face module name; paratron fuses it into "
                              f"{hf[t]!r} ({', '.join(LORA_TARGETS[hf[t]])}): list {hf[t]!r}")
        if t not in LORA_TARGETS:
            raise ConfigError(f"model.lora_targets: unknown target {t!r}; choose from {sorted(LORA_TARGETS)}")


def check_shape(cfg: ModelConfig, tp: int) -> None:
    """Check the model's sizes against tensor-parallel size ``tp``, before any collective (config
    validation runs this before the vocab size is known).

    Raises:
        ConfigError: naming the field, value and rule: sizes not positive; hidden size not
            divisible by heads; heads or KV groups not divisible by ``tp``; heads not divisible by
            KV groups; odd RoPE head dim; MLP width not divisible by ``tp``; a sequence longer
            than the learned position table; a rule of :func:`check_mla` (under
            ``multi_latent_attention``) or :func:`check_mtp`.
    """
    check_lora(cfg)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        v = getattr(cfg, name)
        if v < (0 if name == "num_layers" else 1):
            raise ConfigError(f"model.{name}={v} must be a positive integer")
    heads, groups = cfg.num_attention_heads, query_groups(cfg)
    if cfg.kv_channels is not None and cfg.kv_channels < 1:
        raise ConfigError(f"model.kv_channels={cfg.kv_channels} must be a positive integer (or unset: "
                          "hidden_size / num_attention_heads)")
    if cfg.multi_latent_attention:
        check_mla(cfg)
    elif cfg.kv_channels is None and cfg.hidden_size % heads:
        raise ConfigError(f"model.hidden_size={cfg.hidden_size} is not divisible by "
                          f"model.num_attention_heads={heads} (or set model.kv_channels, the head width)")
    if groups < 1 or heads % groups:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by "
                          f"model.num_query_groups={groups}")
    if heads % tp:
        raise ConfigError(f"model.num_attention_heads={heads} is not divisible by parallel.tensor={tp}")
    if groups % tp:
        raise ConfigError(f"model.num_query_groups={groups} is not divisible by parallel.tensor={tp} "
                          "(each tensor-parallel rank holds whole KV groups)")
    if cfg.position_embedding_type == "rope" and not cfg.multi_latent_attention and head_dim(cfg) % 2:
        where = "model.kv_channels" if cfg.kv_channels is not None else \
            "model.hidden_size/model.num_attention_heads"
        raise ConfigError(f"RoPE needs an even head dim; {where} = {head_dim(cfg)}")
    if ffn_size(cfg) % tp:
        raise ConfigError(f"model.ffn_hidden_size={ffn_size(cfg)} is not divisible by parallel.tensor={tp}")
    if cfg.position_embedding_type == "learned" and cfg.seq_length > max_positions(cfg):
        raise ConfigError(f"model.seq_length={cfg.seq_length} exceeds "
                          f"model.max_position_embeddings={max_positions(cfg)}")
    check_mtp(cfg)


def check_mtp(cfg: ModelConfig) -> None:
    """Rules of multi-token prediction (DeepSeek-V3 section 2.2).

    Raises:
        ConfigError: ``mtp_num_layers`` negative, or so large that the last module has no target
            (module ``k`` predicts the token ``k + 1`` places after the next one, so a sequence
            of ``s`` tokens allows at most ``s - 1`` modules); a negative
            ``mtp_loss_scaling_factor``.
    """
    d, s = cfg.mtp_num_layers, cfg.seq_length
    if d < 0 or d > s - 1:
        raise ConfigError(f"model.mtp_num_layers={d} must be in [0, model.seq_length-1 = {s - 1}]: module k "
                          f"predicts the token k+1 places after the next, which a {s}-token sequence must hold")
    if cfg.mtp_loss_scaling_factor < 0:
        raise ConfigError(f"model.mtp_loss_scaling_factor={cfg.mtp_loss_scaling_factor} must be >= 0")


def check_mla(cfg: ModelConfig) -> None:
    """Rules of multi-head latent attention (DeepSeek-V2 section 2.1).

    Raises:
        ConfigError: naming the field, value and rule: a low rank (``q_lora_rank``,
            ``kv_lora_rank``) outside ``[1, hidden_size]`` (a rank above h is no compression);
            a head width below 1; an odd or missing RoPE part (``qk_pos_emb_head_dim``, MLA
            needs ``position_embedding_type = "rope"``); ``v_head_dim`` above the query/key head
            (the values are zero-padded to it for the shared attention kernels);
            ``num_query_groups`` set to other than the head count (MLA keys are per head);
            ``kv_channels`` set (MLA has its own head widths).
    """
    h = cfg.hidden_size
    for name in ("q_lora_rank", "kv_lora_rank"):
        v = getattr(cfg, name)
        if v is not None and not 1 <= v <= h:
            raise ConfigError(f"model.{name}={v} must be in [1, model.hidden_size={h}] "
                              "(multi-head latent attention compresses below the hidden size)")
    for name in ("qk_head_dim", "v_head_dim"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"model.{name}={getattr(cfg, name)} must be a positive integer")
    rope = cfg.qk_pos_emb_head_dim
    if cfg.position_embedding_type != "rope" or rope < 2 or rope % 2:
        raise ConfigError(f"model.multi_latent_attention=true needs model.position_embedding_type=\"rope\" and an "
                          f"even model.qk_pos_emb_head_dim >= 2 (got {cfg.position_embedding_type!r}, {rope})")
    if cfg.v_head_dim > cfg.qk_head_dim + rope:
        raise ConfigError(f"model.v_head_dim={cfg.v_head_dim} exceeds the query/key head "
                          f"model.qk_head_dim+model.qk_pos_emb_head_dim = {cfg.qk_head_dim + rope}")
    if cfg.num_query_groups not in (None, cfg.num_attention_heads):
        raise ConfigError(f"model.num_query_groups={cfg.num_query_groups} with model.multi_latent_attention=true: "
                          "MLA has one key/value head per query head; leave it unset")
    if cfg.kv_channels is not None:
        raise ConfigError(f"model.kv_channels={cfg.kv_channels} with model.multi_latent_attention=true: MLA's head "
                          "widths are model.qk_head_dim, model.qk_pos_emb_head_dim and model.v_head_dim")


def check_moe(cfg: ModelConfig, *, tp: int, ep: int, expert_tp: int) -> None:
    """Check the MoE fields against the tensor-, expert- and expert-tensor-parallel sizes, before
    any collective (a dense model, ``num_experts == 0``, passes unless ``ep > 1``).

    Raises:
        ConfigError: naming the field, value and rule: a negative expert count; expert parallelism
            without experts; experts not divisible by ``ep``; ``moe_top_k`` outside
            ``[1, num_experts]``; ``moe_layer_freq < 1``; ``first_k_dense_replace`` negative, set
            on a dense model, or leaving no MoE layer; a capacity factor <= 0; padding to
            capacity without a capacity factor; an expert width not divisible by ``expert_tp``; a
            shared-expert width not divisible by ``tp``; a rule of :func:`check_routing`.
    """
    E = cfg.num_experts
    if E < 0:
        raise ConfigError(f"model.num_experts={E} must be >= 0")
    if cfg.first_k_dense_replace < 0:
        raise ConfigError(f"model.first_k_dense_replace={cfg.first_k_dense_replace} must be >= 0")
    if E == 0:
        if ep > 1:
            raise ConfigError(f"parallel.expert={ep} needs model.num_experts > 0")
        if cfg.first_k_dense_replace:
            raise ConfigError(f"model.first_k_dense_replace={cfg.first_k_dense_replace} makes the first "
                              "layers dense instead of MoE, but model.num_experts=0: every layer is dense")
        return
    if E % ep:
        raise ConfigError(f"model.num_experts={E} is not divisible by parallel.expert={ep}")
    if not 1 <= cfg.moe_top_k <= E:
        raise ConfigError(f"model.moe_top_k={cfg.moe_top_k} must be in [1, model.num_experts={E}]")
    if cfg.moe_layer_freq < 1:
        raise ConfigError(f"model.moe_layer_freq={cfg.moe_layer_freq} must be >= 1")
    if not any(is_moe_layer(cfg, i) for i in range(cfg.num_layers)):
        raise ConfigError(f"model.first_k_dense_replace={cfg.first_k_dense_replace} with model.num_layers="
                          f"{cfg.num_layers} and model.moe_layer_freq={cfg.moe_layer_freq} leaves no MoE layer "
                          "(the first first_k_dense_replace layers are dense)")
    if cfg.moe_capacity_factor is not None and cfg.moe_capacity_factor <= 0:
        raise ConfigError(f"model.moe_capacity_factor={cfg.moe_capacity_factor} must be > 0 (or unset: dropless)")
    if cfg.moe_pad_to_capacity and cfg.moe_capacity_factor is None:
        raise ConfigError("model.moe_pad_to_capacity=true needs model.moe_capacity_factor to be set")
    check_routing(cfg)
    width = expert_ffn_size(cfg)
    if width % expert_tp:
        field = "moe_ffn_hidden_size" if cfg.moe_ffn_hidden_size is not None else "ffn_hidden_size"
        raise ConfigError(f"model.{field}={width} (the expert width) is not divisible by "
                          f"parallel.expert_tensor={expert_tp}")
    shared = cfg.moe_shared_expert_ffn_hidden_size
    if cfg.moe_shared_expert_gate and not shared:
        raise ConfigError("model.moe_shared_expert_gate=true needs model.moe_shared_expert_ffn_hidden_size")
    if shared is not None and shared % tp:
        raise ConfigError(f"model.moe_shared_expert_ffn_hidden_size={shared} is not divisible by "
                          f"parallel.tensor={tp}")


def check_routing(cfg: ModelConfig) -> None:
    """Rules of the router options (an MoE model, ``num_experts > 0``).

    Raises:
        ConfigError: ``moe_router_bias_update_rate < 0``; ``moe_router_topk_scaling_factor <= 0``; only one of ``moe_router_num_groups`` /
            ``moe_router_group_topk`` set; groups not dividing ``num_experts``; ``group_topk``
            outside ``[1, num_groups]`` or above ``moe_top_k`` (each chosen group contributes
            ``moe_top_k // group_topk`` scores to its group score); ``moe_top_k`` above the
            experts of the chosen groups.
    """
    if cfg.moe_router_bias_update_rate < 0:
        raise ConfigError(f"model.moe_router_bias_update_rate={cfg.moe_router_bias_update_rate} must be >= 0")
    factor = cfg.moe_router_topk_scaling_factor
    if factor is not None and not factor > 0:
        raise ConfigError(f"model.moe_router_topk_scaling_factor={factor} must be > 0 (or unset: 1)")
    groups, gk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if groups is None and gk is None:
        return
    if groups is None or gk is None:
        raise ConfigError("model.moe_router_num_groups and model.moe_router_group_topk go together: "
                          f"got {groups} and {gk}")
    E, k = cfg.num_experts, cfg.moe_top_k
    if groups < 1 or E % groups:
        raise ConfigError(f"model.moe_router_num_groups={groups} must be >= 1 and divide model.num_experts={E}")
    if not 1 <= gk <= min(groups, k):
        raise ConfigError(f"model.moe_router_group_topk={gk} must be in [1, min(moe_router_num_groups={groups}, "
                          f"moe_top_k={k})]")
    if k > gk * (E // groups):
        raise ConfigError(f"model.moe_top_k={k} exceeds the {gk * (E // groups)} experts of "
                          f"model.moe_router_group_topk={gk} groups of {E // groups}")
