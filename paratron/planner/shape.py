"""The sizes of a model that the cost terms need, read once from its :class:`ModelConfig`."""

from __future__ import annotations

from dataclasses import dataclass

from paratron.config import ModelConfig
from paratron.layers.embedding import pad_vocab_size
from paratron.config import model_shape as spec


@dataclass(frozen=True)
class Shape:
    """h (hidden), n (query heads), g (KV groups), d (head dim), f (MLP width), V (vocab), L (layers),
    s (sequence length), and the MLP kind; ``moe`` fields are 0 for a dense model."""

    h: int
    n: int
    g: int
    d: int
    f: int
    V: int
    L: int
    s: int
    swiglu: bool
    bias: bool
    tied: bool
    learned_pos: bool
    max_pos: int
    layernorm: bool
    dropout: bool
    experts: int
    top_k: int
    expert_f: int
    moe_freq: int
    vocab_multiple: int = 128
    first_dense: int = 0
    qk_norm: bool = False
    shared_f: int = 0
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert
    low_rank: int = 0  # CoLA rank r of every attention/MLP projection (0: full rank; docs/boost.md)
    low_rank_tp: str = "naive"
    low_rank_recompute: bool = False

    @classmethod
    def of(cls, m: ModelConfig, seq_length: int) -> "Shape":
        f = spec.ffn_size(m)
        return cls(h=m.hidden_size, n=m.num_attention_heads, g=spec.query_groups(m), d=spec.head_dim(m), f=f,
                   V=m.vocab_size, L=m.num_layers, s=seq_length, swiglu=m.activation == "swiglu",
                   bias=m.add_bias_linear, tied=m.tie_embeddings, learned_pos=m.position_embedding_type == "learned",
                   max_pos=spec.max_positions(m), layernorm=m.normalization == "layernorm",
                   dropout=m.hidden_dropout > 0 or m.attention_dropout > 0, experts=m.num_experts,
                   top_k=m.moe_top_k if m.num_experts else 0, expert_f=spec.expert_ffn_size(m),
                   vocab_multiple=m.make_vocab_size_divisible_by,
                   moe_freq=max(m.moe_layer_freq, 1), first_dense=m.first_k_dense_replace,
                   qk_norm=m.qk_layernorm, shared_f=(m.moe_shared_expert_ffn_hidden_size or 0) if m.num_experts else 0,
                   shared_gate=bool(m.moe_shared_expert_gate) and bool(m.num_experts),
                   low_rank=m.low_rank, low_rank_tp=m.low_rank_tp, low_rank_recompute=m.low_rank_recompute)

    def is_moe(self, layer: int) -> bool:
        # a dense model answers first: the planner asks this of every layer of ~1e6 layouts
        return self.experts > 0 and spec.moe_at(layer, self.experts, self.moe_freq, self.first_dense)

    def has_dense_mlp(self) -> bool:
        """Whether some layer runs the dense MLP: every layer of a dense model; in an MoE model,
        layer 0 under ``first_dense > 0``, else layer 1 under ``moe_freq > 1``."""
        return self.experts == 0 or self.first_dense > 0 or (self.moe_freq > 1 and self.L > 1)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded as the embedding pads it (a multiple of ``tp * vocab_multiple``)."""
        return pad_vocab_size(self.V, tp, self.vocab_multiple)

    def layer_params(self, layer: int, tp: int, ep: int) -> int:
        """Parameters of one transformer layer held by one (tp, ep) rank (norms replicated)."""
        if self.low_rank:
            return self.low_rank_layer_params(tp)
        h, bias = self.h, int(self.bias)
        qkv = (self.n + 2 * self.g) * self.d
        attn = (h * qkv + qkv * bias + self.n * self.d * h) // tp + h * bias
        mats = 3 if self.swiglu else 2
        if self.is_moe(layer):
            mlp = self.expert_params(layer, ep)
            mlp += h * self.experts  # router, replicated
            mlp += (mats * h * self.shared_f + (mats - 1) * self.shared_f * bias) // tp + h * bias * (self.shared_f > 0)
        else:
            mlp = (mats * h * self.f + (mats - 1) * self.f * bias) // tp + h * bias
        return attn + mlp + 2 * self.norm_params() + 2 * self.d * int(self.qk_norm)

    def low_rank_widths(self) -> list[tuple[int, int]]:
        """``(in, out)`` of every low-rank projection of a layer: q, k, v, proj, the MLP's."""
        nd, gd, h, f = self.n * self.d, self.g * self.d, self.h, self.f
        mlp = [(h, f), (h, f), (f, h)] if self.swiglu else [(h, f), (f, h)]
        return [(h, nd), (h, gd), (h, gd), (nd, h)] + mlp

    def low_rank_layer_params(self, tp: int) -> int:
        """Parameters of one low-rank layer on one TP rank: ``r (in + out) / tp`` per projection
        (either plan splits one factor of each), norms replicated (naive) or split (bottleneck)."""
        norms = 2 * self.h // (tp if self.low_rank_tp == "bottleneck" else 1)
        return sum(self.low_rank * (i + o) // tp for i, o in self.low_rank_widths()) + norms

    def expert_params(self, layer: int, ep: int) -> int:
        """Parameters of one layer's routed experts held by one EP rank (0 for a dense layer;
        experts are not split over TP)."""
        if not self.is_moe(layer):
            return 0
        h, bias, mats = self.h, int(self.bias), 3 if self.swiglu else 2
        return (self.experts // ep) * (mats * h * self.expert_f + (mats - 1) * self.expert_f * bias + h * bias)

    def norm_params(self) -> int:
        return self.h * (2 if self.layernorm else 1)

    def total_params(self) -> int:
        """Parameters of the whole model (no padding; tied embedding counted once)."""
        emb = self.V * self.h * (1 if self.tied else 2) + (self.max_pos * self.h if self.learned_pos else 0)
        return emb + sum(self.layer_params(i, 1, 1) for i in range(self.L)) + self.norm_params()
