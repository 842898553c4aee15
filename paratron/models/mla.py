"""Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", section 2.1; kept in
DeepSeek-V3, section 2.1.1), split over tensor-parallel ranks.

Per token ``x`` (``[h]``), with ``n`` heads, ``d_n = qk_head_dim``, ``d_r = qk_pos_emb_head_dim``,
``d_v = v_head_dim``:

    c_q  = RMSNorm(W_DQ x)                       [q_lora_rank]   (or no query compression)
    q    = W_UQ c_q -> per head [q_nope (d_n); q_rope (d_r)], q_rope rotated by RoPE
    [c_kv; k_r] = W_DKV x                        [kv_lora_rank + d_r]
    k_rope = RoPE(k_r)                            one RoPE key shared by every head
    [k_nope; v] = W_UKV RMSNorm(c_kv) -> per head [d_n; d_v]
    o    = softmax([q_nope; q_rope] . [k_nope; k_rope] / sqrt(d_n + d_r)) v,   out = W_O o

Tensor parallelism: the up-projections ``W_UQ`` / ``W_UKV`` are column-parallel (each rank holds
``n / tp`` heads) and ``W_O`` is row-parallel, as for ordinary attention. The down-projections
``W_DQ`` / ``W_DKV`` and the latent norms produce the per-token latent every head needs, so they
are replicated: without sequence parallelism each rank computes them on the same tokens (equal
grads: the column-parallel up-projections all-reduce the latent's grad); under sequence
parallelism each rank computes them on its ``s / tp`` tokens (weights marked
``sequence_parallel``: their partial grads are summed over TP) and the up-projections
all-gather the latent along the sequence. The shared RoPE key ``k_rope`` reaches every rank's
heads through the same all-gather (SP) or an identity whose backward all-reduces (no SP).

Context parallelism and packed documents: the heads go through
:func:`~paratron.models.context_parallel.context_attention`, whose kernels take one head width
for q, k and v; the values are zero-padded from ``d_v`` to ``d_n + d_r`` and the padding is cut
off the output (exact: zero columns of v give zero output columns and no grad elsewhere; the
softmax scale comes from the q/k width). Plain attention calls SDPA with the narrower values.

Parameters (logical names under ``layers.{i}.attention``): ``q_down.weight`` ``[q_lora_rank, h]``,
``q_norm.weight``, ``q_up.weight`` ``[n (d_n + d_r), q_lora_rank]`` (or ``q_proj.weight``
``[n (d_n + d_r), h]`` without query compression), ``kv_down.weight`` ``[kv_lora_rank + d_r, h]``,
``kv_norm.weight``, ``kv_up.weight`` ``[n (d_n + d_v), kv_lora_rank]`` (per head: its ``d_n``
key rows, then its ``d_v`` value rows), ``proj.weight`` ``[h, n d_v]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear
from paratron.layers.init import init_shard_, normal_
from paratron.layers.linear import local_linear
from paratron.parallel.context import ParallelContext
from paratron.parallel.mappings import copy_to_tp_region, gather_from_sequence_parallel_region
from paratron.parallel.params import ShardSpec, mark

from .attention import attention_core
from .context_parallel import context_attention
from .recompute import checkpointed
from .rope import apply_rope


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with the whole ``[out, in]`` weight on every TP rank (no collective).

    ``sequence_parallel``: the input is this rank's ``[s/tp, b, in]`` tokens, so the weight's
    grads are partial sums over TP (the weight is marked ``sequence_parallel``; the grad
    finalisation sums them). Weight grads take the linears' path (deferrable to a zero-bubble W
    action through ``weight_grad_store``).
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, *, logical_name: str, seed: int,
                 sequence_parallel: bool, init_method, params_dtype: torch.dtype):
        super().__init__()
        name = f"{logical_name}.weight"
        shape = (int(out_features), int(in_features))
        weight = torch.empty(shape, device=ctx.device, dtype=params_dtype)
        self.weight = nn.Parameter(init_shard_(weight, init_method, ShardSpec.replicated(shape), seed, name))
        mark(self.weight, name, sequence_parallel=sequence_parallel and ctx.tp.size > 1)
        self.weight_grad_store = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return local_linear(x, self.weight, None, self)


class LatentAttention(nn.Module):
    """MLA block of one transformer layer (see the module docstring).

    Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same layout, with
    ``rope`` the (cos, sin) tables of width ``qk_pos_emb_head_dim`` and ``layout`` as for
    :class:`~paratron.models.attention.SelfAttention`.

    The rules of :func:`paratron.config.model_shape.check_mla` (heads divisible by the TP size,
    ...) are checked before, once, by the config rules and :func:`~paratron.models.gpt.build_model_chunks`.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, layer_number: int, seed: int,
                 sequence_parallel: bool,
                 params_dtype: torch.dtype, rng_tracker=None, output_init=None):
        super().__init__()
        tp = ctx.tp.size
        self.tp = ctx.tp
        self.sp = sequence_parallel and tp > 1
        self.local_heads = cfg.num_attention_heads // tp
        self.nope, self.rope_dim, self.v_dim = cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.attention_dropout = cfg.attention_dropout
        self.selective_recompute = cfg.recompute == "selective"
        self.rng_tracker = rng_tracker
        n, h, qk = cfg.num_attention_heads, cfg.hidden_size, self.nope + self.rope_dim
        prefix = f"layers.{layer_number}.attention"
        init = normal_(cfg.init_method_std)
        common = dict(ctx=ctx, seed=seed, params_dtype=params_dtype)

        def column(name, d_in, d_out, sp):
            return ColumnParallelLinear(d_in, d_out, logical_name=f"{prefix}.{name}", bias=False,
                                        sequence_parallel=sp, init_method=init, **common)

        def latent_norm(name, d):
            return RMSNorm(d, ctx, logical_name=f"{prefix}.{name}", eps=cfg.norm_epsilon,
                           sequence_parallel=self.sp, params_dtype=params_dtype)

        if cfg.q_lora_rank is None:
            self.q_proj = column("q_proj", h, n * qk, sequence_parallel)
        else:
            self.q_down = ReplicatedLinear(h, cfg.q_lora_rank, logical_name=f"{prefix}.q_down",
                                           sequence_parallel=sequence_parallel, init_method=init, **common)
            self.q_norm = latent_norm("q_norm", cfg.q_lora_rank)
            self.q_up = column("q_up", cfg.q_lora_rank, n * qk, sequence_parallel)
        self.kv_down = ReplicatedLinear(h, self.kv_rank + self.rope_dim, logical_name=f"{prefix}.kv_down",
                                        sequence_parallel=sequence_parallel, init_method=init, **common)
        self.kv_norm = latent_norm("kv_norm", self.kv_rank)
        self.kv_up = column("kv_up", self.kv_rank, n * (self.nope + self.v_dim), sequence_parallel)
        self.proj = RowParallelLinear(n * self.v_dim, h, ctx, logical_name=f"{prefix}.proj", seed=seed,
                                      bias=cfg.add_bias_linear, input_is_parallel=True,
                                      sequence_parallel=sequence_parallel, init_method=output_init,
                                      params_dtype=params_dtype)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_up(self.q_norm(self.q_down(x)))
        return q.view(q.shape[0], q.shape[1], self.local_heads, self.nope + self.rope_dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                layout=None) -> torch.Tensor:
        q = self._queries(x)                                     # [s, b, n/tp, d_n + d_r]
        c_kv, k_rope = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_up(self.kv_norm(c_kv))                      # [s, b, n/tp * (d_n + d_v)]
        s, b = kv.shape[:2]
        # The shared RoPE key: gathered along s (SP), else identity forward / all-reduce backward.
        k_rope = gather_from_sequence_parallel_region(k_rope, self.tp) if self.sp else copy_to_tp_region(k_rope, self.tp)
        k_nope, v = kv.view(s, b, self.local_heads, self.nope + self.v_dim).split([self.nope, self.v_dim], dim=-1)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        k_rope = k_rope.unsqueeze(2)
        if rope is not None:
            q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.local_heads, -1)], dim=-1)
        return self.proj(self._attend(q, k, v.contiguous(), layout))

    def _attend(self, q, k, v, layout) -> torch.Tensor:
        """``[s, b, n/tp * d_v]`` of causal attention (see the module docstring for the padding)."""
        s, b, heads, qk = q.shape
        if layout is not None and layout.needs_custom_attention:
            padded = F.pad(v, (0, qk - self.v_dim))
            out = context_attention(q, k, padded, layout, attention_core).view(s, b, heads, qk)
            return out[..., :self.v_dim].reshape(s, b, heads * self.v_dim)
        p = self.attention_dropout if self.training else 0.0
        if self.selective_recompute:
            return checkpointed(attention_core, q, k, v, p, self.rng_tracker, rng_tracker=self.rng_tracker)
        return attention_core(q, k, v, p, self.rng_tracker)


def latent_attention(inputs, name: str) -> nn.Module:
    """Layer-spec builder (:mod:`paratron.models.layer_spec`) of :class:`LatentAttention`
    (parameters named ``{prefix}.attention.*``)."""
    return LatentAttention(inputs.cfg, inputs.ctx, layer_number=inputs.layer_number, seed=inputs.seed,
                           sequence_parallel=inputs.sequence_parallel, params_dtype=inputs.params_dtype,
                           rng_tracker=inputs.rng_tracker, output_init=inputs.output_init())
