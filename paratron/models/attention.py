"""Self-attention: multi-head or grouped-query, optional RoPE, split over tensor-parallel ranks.

Tensor parallelism splits attention by heads (Shoeybi et al. 2019, section 3, figure 3b): the
fused QKV projection is column-parallel, each rank attends with its own heads, and the output
projection is row-parallel. Grouped-query attention (Ainslie et al. 2023, "GQA") shares one K/V
head among ``num_attention_heads / num_query_groups`` query heads; each TP rank holds whole
groups, so the KV groups must divide by the TP size.

Fused QKV layout of the full weight ``[(heads + 2 * groups) * d, h]``: for each KV group ``j`` in
order, the ``heads/groups`` query heads of that group, then its key head, then its value head.
A contiguous row slice of ``1/tp`` is then ``groups/tp`` whole groups, and a TP rank needs no
reshuffle (query head ``j * heads/groups + r`` belongs to group ``j``, as in Hugging Face's
``repeat_kv``).

QK-norm (``model.qk_layernorm``; Dehghani et al. 2023, "Scaling Vision Transformers to 22B",
section 3.1; Qwen3): the config's norm over each head's ``d`` query and key channels, before
RoPE, with one ``[d]`` weight for all query heads and one for all key heads. Each TP rank
normalises its own heads, so the replicated weights get partial grads on each TP rank; they are
marked like sequence-parallel norm weights, whose grads are summed over TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers import ColumnParallelLinear, RowParallelLinear
from paratron.layers.dropout import rng_fork
from paratron.layers.init import normal_
from paratron.parallel.context import ParallelContext

from .context_parallel import context_attention
from .norms import make_norm
from .recompute import checkpointed
from .rope import apply_rope


# Under ``model.compile`` on the CPU, sequences up to this long take the blocked composite form
# (:func:`blocked_causal_attention`); beyond it, its saved probabilities (~s^2/2 per head) grow
# past what its speed is worth and torch's flash kernel stays.
COMPOSITE_MAX_SEQ = 512


def blocked_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention as batched GEMMs and a masked softmax, in query blocks.

    The ``s`` queries are taken in blocks of ``max(32, s // 8)`` rows (at most 8 blocks); a block
    whose last query is at position ``e - 1`` multiplies against keys ``[0, e)`` only, so the
    tiles above the diagonal are skipped, as FlashAttention skips masked tiles (Dao et al. 2022,
    section 3.1), but each block keeps its whole rows and a plain softmax instead of an online
    one. Autograd derives the backward, which keeps each block's probabilities.

    Under ``model.compile`` on the CPU :func:`attention_core` takes this form for ``s <=``
    :data:`COMPOSITE_MAX_SEQ`: inductor fuses the scale, mask and softmax around the GEMMs, and
    the forward and backward take 0.59-0.83x the time of torch's CPU flash kernel at ``s`` 128 to
    1024 (``benchmarks/bench_attention.py``), at the cost of saving ~``s^2 / 2`` probabilities
    per head and sample where flash saves its output and log-sum-exp.

    Args:
        q: ``[s, b, n_q, d]``; k, v: ``[s, b, n_kv, d]`` and ``[s, b, n_kv, d_v]``, ``n_q`` a
            multiple of ``n_kv`` (query head ``j * n_q / n_kv + i`` uses key/value head ``j``).
    Returns:
        ``[s, b, n_q * d_v]``; the softmax in fp32 for 16-bit inputs (as the flash kernels).
    """
    s, b, n_q, d = q.shape
    n_kv, d_v = k.shape[2], v.shape[-1]
    r, block = n_q // n_kv, max(32, s // 8)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    qh = q.permute(1, 2, 0, 3).reshape(b, n_kv, r, s, d) * d ** -0.5
    kh, vh = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, n_kv, s, d]
    outs = []
    for start in range(0, s, block):
        end = min(start + block, s)
        rows = end - start
        scores = torch.matmul(qh[:, :, :, start:end].reshape(b, n_kv, r * rows, d), kh[:, :, :end].transpose(-1, -2))
        future = torch.arange(end, device=q.device) > torch.arange(start, end, device=q.device).unsqueeze(1)
        probs = scores.view(b, n_kv, r, rows, end).masked_fill(future, float("-inf")).softmax(-1, dtype=softmax_dtype)
        out = torch.matmul(probs.to(v.dtype).view(b, n_kv, r * rows, end), vh[:, :, :end])
        outs.append(out.view(b, n_kv, r, rows, d_v))
    out = torch.cat(outs, dim=3).view(b, n_q, s, d_v)
    return out.permute(2, 0, 1, 3).reshape(s, b, n_q * d_v)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   rng_tracker=None) -> torch.Tensor:
    """Causal scaled dot-product attention through ``F.scaled_dot_product_attention``.

    Args:
        q: ``[s, b, n_q, d]`` query heads of this TP rank.
        k, v: ``[s, b, n_kv, d]`` key/value heads (``n_q`` a multiple of ``n_kv``); ``v`` may
            have another head width ``d_v`` (multi-head latent attention).
        dropout_p: attention dropout probability (0 in eval).
        rng_tracker: dropout draws from its ``model-parallel`` stream, since each TP rank holds
            different heads and must draw different masks (Shoeybi et al. 2019, section 3).
    Returns:
        ``[s, b, n_q * d_v]``.

    Under ``model.compile`` on the CPU, with grad mode on (training), without dropout and for
    ``s <=`` :data:`COMPOSITE_MAX_SEQ`, the same attention in :func:`blocked_causal_attention`'s
    form.

    Softmax precision: for bf16/fp16 inputs every SDPA backend computes the softmax in fp32: the
    flash kernels (GPU, and the CPU one) accumulate in fp32, and the math fallback (taken with
    dropout on CPU) upcasts to fp32 unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp``
    is switched on (off by default since torch 2.5). So no upcast is needed here.
    """
    s, b, n_q = q.shape[:3]
    n_kv = k.shape[2]
    # Training only: generation grows the sequence a token at a time, where SDPA's graph, traced
    # with a dynamic length, serves every length and the blocked form's loop would recompile.
    if (dropout_p == 0.0 and s <= COMPOSITE_MAX_SEQ and q.device.type == "cpu" and torch.is_grad_enabled()
            and torch.compiler.is_compiling()):
        return blocked_causal_attention(q, k, v)
    # SDPA wants [b, heads, s, d].
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if q.device.type == "meta" and dropout_p == 0.0 and v.shape[-1] == q.shape[-1]:
        # Dry run (paratron.dryrun): SDPA's backend choice has no meta entry and would take the
        # math path, which saves the [s, s] probabilities; real runs take a flash kernel. torch's
        # CPU flash op has a meta kernel and saves what a flash kernel saves (output, log-sum-exp).
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    else:
        with rng_fork(rng_tracker, dropout_p > 0.0):
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                 enable_gqa=n_kv != n_q)
    return out.permute(2, 0, 1, 3).reshape(s, b, n_q * v.shape[-1])


class SelfAttention(nn.Module):
    """Attention block of one transformer layer: fused QKV (column-parallel), RoPE, causal SDPA,
    output projection (row-parallel).

    Forward: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) -> same layout.
    Parameters (logical names under ``layers.{i}.attention``): ``qkv.weight`` ``[(n + 2g) d, h]``,
    ``proj.weight`` ``[h, n d]``, and their biases when ``add_bias_linear``; ``q_norm.weight`` and
    ``k_norm.weight`` ``[d]`` under QK-norm.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, layer_number: int, seed: int,
                 sequence_parallel: bool,
                 params_dtype: torch.dtype, rng_tracker=None, output_init=None):
        super().__init__()
        tp = ctx.tp.size
        self.head_dim = model_shape.head_dim(cfg)
        heads, groups = cfg.num_attention_heads, model_shape.query_groups(cfg)
        self.q_per_group = heads // groups
        self.local_groups = groups // tp
        self.attention_dropout = cfg.attention_dropout
        self.selective_recompute = cfg.recompute == "selective"
        self.rng_tracker = rng_tracker
        prefix = f"layers.{layer_number}.attention"
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, (heads + 2 * groups) * self.head_dim, ctx, logical_name=f"{prefix}.qkv",
            seed=seed, bias=model_shape.qkv_bias(cfg), sequence_parallel=sequence_parallel,
            init_method=normal_(cfg.init_method_std), params_dtype=params_dtype)
        # Which rows are Q, K and V (per KV group), for optimizers that treat them as matrices.
        self.qkv.weight.meta.qkv_split = (groups, (self.q_per_group * self.head_dim, self.head_dim, self.head_dim))
        self.proj = RowParallelLinear(
            heads * self.head_dim, cfg.hidden_size, ctx, logical_name=f"{prefix}.proj", seed=seed,
            bias=cfg.add_bias_linear, input_is_parallel=True, sequence_parallel=sequence_parallel,
            init_method=output_init, params_dtype=params_dtype)
        self.q_norm = self.k_norm = None
        if cfg.qk_layernorm:
            self.q_norm, self.k_norm = (make_norm(cfg, ctx, f"{prefix}.{n}", tp > 1, params_dtype, self.head_dim)
                                        for n in ("q_norm", "k_norm"))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                layout=None) -> torch.Tensor:
        """``x`` ``[s, b, h]`` (or ``[s/tp, b, h]``); ``rope`` the (cos, sin) tables for the full s;
        ``layout`` the microbatch's :class:`~paratron.models.context_parallel.SeqLayout` (context
        parallelism, packed documents) or None."""
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.q_per_group + 2, self.head_dim)
        # One split (its backward is one cat into the qkv grad), not three slices whose
        # backward would each zero-fill a qkv-sized grad and add it.
        q, k, v = qkv.split([self.q_per_group, 1, 1], dim=3)
        q = q.reshape(s, b, self.local_groups * self.q_per_group, self.head_dim)
        k, v = k.squeeze(3), v.squeeze(3)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        p = self.attention_dropout if self.training else 0.0
        if layout is not None and layout.needs_custom_attention:
            # Context parallelism / packed documents (no attention dropout there: config rule).
            ctx_out = context_attention(q, k, v, layout, attention_core)
        elif self.selective_recompute:
            ctx_out = checkpointed(attention_core, q, k, v, p, self.rng_tracker, rng_tracker=self.rng_tracker)
        else:
            ctx_out = attention_core(q, k, v, p, self.rng_tracker)
        return self.proj(ctx_out)
