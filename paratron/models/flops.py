"""Model FLOPs per token, for TFLOP/s and MFU in the training log.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", appendix: FLOPs calculation) count the matrix multiplications of a GPT layer.
Per token, one forward pass of one layer with hidden size ``h``, sequence length ``s`` and MLP
width ``4h`` costs ``24 h^2 + 4 s h`` FLOPs (a multiply-add counts 2) and the output layer
``2 h V``; the backward pass costs twice the forward, so training without recompute costs

    F = 72 l h^2 (1 + s / (6 h) + V / (12 l h))    per token

(their equation, divided by ``B s``, without the recompute term). We count the same products
term by term so that each one generalises:

* attention projections: ``2 h (n d + 2 g d)`` for Q, K, V with ``n`` query heads, ``g`` KV
  groups of head dim ``d`` (GQA, Ainslie et al. 2023; ``g = n`` is multi-head, giving ``6 h^2``),
  plus ``2 (n d) h`` for the output projection;
* attention scores and the weighted sum: ``2 s (n d)`` each (``4 s h``; the causal mask is not
  subtracted, as in Megatron);
* dense MLP: ``2 h f`` per weight matrix: 2 matrices for GELU (``16 h^2`` at ``f = 4h``),
  3 for SwiGLU (gate, up, down);
* MoE layer: ``moe_top_k`` experts of width ``moe_ffn_hidden_size`` per token, plus the shared
  expert if any, plus the router ``2 h E``;
* output layer: ``2 h V``; the same for tied and untied embeddings (the input lookup is no
  matmul). ``V`` is ``model.vocab_size`` (unpadded: padding columns are not model FLOPs).
* multi-head latent attention (DeepSeek-V2 section 2.1): each projection ``2 x in x out``
  (query down ``h -> r_q`` and up ``r_q -> n (d_n + d_r)``, or one ``h -> n (d_n + d_r)``; KV down
  ``h -> r_kv + d_r`` and up ``r_kv -> n (d_n + d_v)``; output ``n d_v -> h``), scores
  ``2 s n (d_n + d_r)`` and weighted sum ``2 s n d_v``;
* low-rank projections (``model.low_rank = r``, CoLA): ``2 r (in + out)`` per ``B silu(A x)``;
* each multi-token-prediction module (DeepSeek-V3 section 2.2): its projection ``2 (2h) h``, one
  more layer (dense or MoE as its layer number says) and one more output layer ``2 h V``.

Training = 3 x forward. These are *model* FLOPs (Chowdhery et al. 2022, appendix B): recompute
is excluded unless ``include_recompute`` asks for the hardware count.
"""

from __future__ import annotations

from paratron.config import ModelConfig, model_shape


def _mlp_flops(h: int, f: int, activation: str) -> float:
    matrices = 3 if activation == "swiglu" else 2
    return 2.0 * h * f * matrices


def _attention_projection_flops(cfg: ModelConfig) -> float:
    h, n = cfg.hidden_size, cfg.num_attention_heads
    if not cfg.multi_latent_attention:
        g, d = model_shape.query_groups(cfg), model_shape.head_dim(cfg)
        return 2.0 * h * (n * d + 2 * g * d) + 2.0 * n * d * h
    qk, rq, rkv = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
    q = 2.0 * h * n * qk if rq is None else 2.0 * h * rq + 2.0 * rq * n * qk
    kv = 2.0 * h * (rkv + cfg.qk_pos_emb_head_dim) + 2.0 * rkv * n * (cfg.qk_head_dim + cfg.v_head_dim)
    return q + kv + 2.0 * n * cfg.v_head_dim * h


def _attention_core_flops(cfg: ModelConfig, s: int) -> float:
    """Scores and weighted sum of one layer per token (the part selective recompute redoes)."""
    n = cfg.num_attention_heads
    if not cfg.multi_latent_attention:
        return 4.0 * s * n * model_shape.head_dim(cfg)
    return 2.0 * s * n * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim)


def _low_rank_flops(cfg: ModelConfig) -> tuple[float, float]:
    """(attention projections, MLP) per token of a low-rank layer (``model.low_rank = r``,
    docs/boost.md): ``2 r (in + out)`` per projection ``B silu(A x)``."""
    h, n, r, f = cfg.hidden_size, cfg.num_attention_heads, cfg.low_rank, model_shape.ffn_size(cfg)
    nd, gd = n * model_shape.head_dim(cfg), model_shape.query_groups(cfg) * model_shape.head_dim(cfg)
    attention = 2.0 * r * ((h + nd) + 2 * (h + gd) + (nd + h))
    return attention, 2.0 * r * (h + f) * (3 if cfg.activation == "swiglu" else 2)


def forward_flops_per_token(cfg: ModelConfig, seq_length: int | None = None) -> float:
    """Forward FLOPs per token (see the module docstring for each term).

    Raises:
        ValueError: ``model.vocab_size`` is unset.
    """
    if cfg.vocab_size is None:
        raise ValueError("model.vocab_size must be set to count FLOPs (the output layer is 2 h V)")
    h, s = cfg.hidden_size, seq_length or cfg.seq_length
    attention = _attention_projection_flops(cfg) + _attention_core_flops(cfg, s)
    dense_mlp = _mlp_flops(h, model_shape.ffn_size(cfg), cfg.activation)
    if cfg.low_rank:
        attention, dense_mlp = _low_rank_flops(cfg)
        attention += _attention_core_flops(cfg, s)
    mtp = cfg.mtp_num_layers
    total = mtp * (4.0 * h * h + 2.0 * h * cfg.vocab_size)
    for layer in range(cfg.num_layers + mtp):
        total += attention
        if model_shape.is_moe_layer(cfg, layer):
            expert = _mlp_flops(h, cfg.moe_ffn_hidden_size or model_shape.ffn_size(cfg), cfg.activation)
            shared = (_mlp_flops(h, cfg.moe_shared_expert_ffn_hidden_size, cfg.activation)
                      if cfg.moe_shared_expert_ffn_hidden_size else 0.0)
            total += cfg.moe_top_k * expert + shared + 2.0 * h * cfg.num_experts
        else:
            total += dense_mlp
    return total + 2.0 * h * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_length: int | None = None, include_recompute: bool = False) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), Narayanan et al. 2021, appendix,
    extended for GQA, SwiGLU and MoE (module docstring).

    Args:
        cfg: the model config (``vocab_size`` set).
        seq_length: tokens per sample (default ``model.seq_length``): the attention terms grow with it.
        include_recompute: add the recomputed forward work (``full``: every layer once more;
            ``selective``: the attention scores and weighted sum), i.e. hardware FLOPs.
    Returns: FLOPs (multiply-add = 2) per token of one training step.
    Raises:
        ValueError: ``model.vocab_size`` is unset.

    Multiply by tokens per step and divide by step seconds for FLOP/s.
    """
    fwd = forward_flops_per_token(cfg, seq_length)
    total = 3.0 * fwd
    if include_recompute and cfg.recompute == "full":
        h, mtp = cfg.hidden_size, cfg.mtp_num_layers
        total += fwd - 2.0 * h * cfg.vocab_size * (1 + mtp) - 4.0 * h * h * mtp  # heads and MTP projections not redone
    elif include_recompute and cfg.recompute == "selective":
        total += (cfg.num_layers + cfg.mtp_num_layers) * _attention_core_flops(cfg, seq_length or cfg.seq_length)
    return total
