"""Low-rank attention and MLP (CoLA; Liu et al. 2025) with BOOST's tensor-parallel
plans (BOOST, MLSys'26): the modules :mod:`paratron.models.layer_spec` builds when
``model.low_rank = r > 0`` (docs/boost.md).

Every projection of the layer (q, k, v, the attention output ``proj``; SwiGLU's ``gate``, ``up``
or GELU's ``fc1``; ``fc2``) is ``B silu(A x)`` (:class:`~paratron.layers.low_rank.LowRankFactor`;
params ``layers.{i}.attention.q.A.weight`` ``[r, h]``, ``...q.B.weight`` ``[n d, r]`` and so on).

``model.low_rank_tp = "naive"``: the residual stream is Megatron's (``[s, b, h]`` replicated, or
``[s/t, b, h]`` under sequence parallelism) and each projection group is column -> row
(:func:`~paratron.layers.low_rank.naive_group`): its full output is all-reduced, so q, k, v and
the MLP's inner activation are whole on every rank and the attention core runs on all heads
(no further collective; its compute is replicated).

``model.low_rank_tp = "bottleneck"``: inside a model chunk the residual stream is split along h
(``[s, b, h/t]``: :func:`residual_stream` slices it after the embedding and all-gathers it before
the final norm, once per chunk). The norms are :class:`~paratron.layers.low_rank.OnlineRMSNorm`
(part of these modules: the layer's own norms are identities), A's are row-parallel on the
sharded input and B's column-parallel, so q, k, v come out split by heads (as in Megatron), the
attention output by heads feeds ``proj``'s A, and ``proj``/``fc2``'s B write the stream's own
h-shard. Per layer and microbatch the forward all-reduces ``s b (7r + 2)`` values (SwiGLU; GELU:
``6r + 2``), and the backward the same.

``model.low_rank_recompute``: each collective-free piece between two bottleneck all-reduces runs
under :func:`~paratron.models.recompute.checkpointed`, so the backward keeps only the pieces'
inputs: the layer input and the mid-layer residual (``h/t`` each), the per-token sums of squares
and the ``r``-wide bottlenecks. The collectives stay outside the recomputed pieces, so the bytes
moved do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from paratron.config import model_shape
from paratron.config.low_rank_rules import check_low_rank_model
from paratron.layers.low_rank import (LowRankFactor, OnlineRMSNorm, bottleneck_a, bottleneck_all_reduce,
                                      bottleneck_b, naive_group)
from paratron.parallel.mappings import gather_from_tp_region, scatter_to_tp_region

from .attention import attention_core
from .context_parallel import context_attention
from .mlp import activate
from .recompute import checkpointed
from .rope import apply_rope

__all__ = ["LowRankAttention", "LowRankMLP", "low_rank_attention", "low_rank_mlp", "uses_online_norm",
           "residual_stream"]


def uses_online_norm(cfg) -> bool:
    """Whether the layer's norms live inside the low-rank modules (the bottleneck plan)."""
    return cfg.low_rank > 0 and cfg.low_rank_tp == "bottleneck"


def residual_stream(cfg, ctx):
    """``(enter, exit)`` of a chunk's hidden-sharded residual stream under the bottleneck plan
    at TP > 1, else None. ``enter``: ``[s, b, h]`` -> this rank's ``[s, b, h/t]`` (backward:
    all-gather of the grad); ``exit``: the all-gather back to ``[s, b, h]`` (backward: slice)."""
    if not uses_online_norm(cfg) or ctx.tp.size == 1:
        return None
    return (lambda h: scatter_to_tp_region(h, ctx.tp)), (lambda h: gather_from_tp_region(h, ctx.tp))


class _LowRankModule(nn.Module):
    """Shared set-up: the plan, the TP group, the recompute switch, the factor builder."""

    def __init__(self, inputs, name: str) -> None:
        super().__init__()
        cfg, ctx = inputs.cfg, inputs.ctx
        check_low_rank_model(cfg, ctx.tp.size, inputs.sequence_parallel)
        self.cfg, self.group, self.inputs = cfg, ctx.tp, inputs
        self.bottleneck = uses_online_norm(cfg)
        self.sp = inputs.sequence_parallel and ctx.tp.size > 1
        self.recompute = cfg.low_rank_recompute
        self.rng_tracker = inputs.rng_tracker
        self.prefix = f"{inputs.prefix}.{name}"
        self.norm = (OnlineRMSNorm(ctx, f"{inputs.prefix}.{self.norm_name}", cfg.hidden_size, cfg.norm_epsilon,
                                   inputs.params_dtype) if self.bottleneck else None)

    def _factor(self, name: str, n_in: int, n_out: int, output: bool = False) -> LowRankFactor:
        i = self.inputs
        return LowRankFactor(i.ctx, f"{self.prefix}.{name}", n_in, n_out, self.cfg.low_rank, self.cfg.low_rank_tp,
                             seed=i.seed, params_dtype=i.params_dtype,
                             b_init=i.output_init() if output else None)

    def _run(self, fn, *args) -> torch.Tensor:
        """``fn(*args)``, recomputed in the backward under ``model.low_rank_recompute``."""
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpointed(fn, *args, rng_tracker=self.rng_tracker)
        return fn(*args)

    def _normed_a(self, x: torch.Tensor, factors) -> torch.Tensor:
        """Bottleneck: the online norm of ``x [s, b, h/t]``, then the grouped A's; summed ``[s, b, sum r]``."""
        sum_sq = bottleneck_all_reduce(self._run(self.norm.local_sum_of_squares, x), self.group)
        partial = self._run(lambda t, ss: bottleneck_a(self.norm.apply(t, ss), factors), x, sum_sq)
        return bottleneck_all_reduce(partial, self.group)

    def _output(self, z: torch.Tensor, factor) -> torch.Tensor:
        """Bottleneck: the last factor's B on the summed bottleneck ``z`` -> ``[s, b, out/t]``."""
        return self._run(lambda t: bottleneck_b(t, [factor])[0], z)


class LowRankAttention(_LowRankModule):
    """Self-attention with low-rank q, k, v and output projections.

    Forward ``(x, rope, layout)``: naive ``[s, b, h]`` (``[s/t, b, h]`` under SP) -> same;
    bottleneck ``[s, b, h/t]`` -> ``[s, b, h/t]`` (its online norm included). ``rope`` and
    ``layout`` as for :class:`~paratron.models.attention.SelfAttention`.
    """

    norm_name = "input_norm"

    def __init__(self, inputs, name: str) -> None:
        super().__init__(inputs, name)
        cfg = inputs.cfg
        self.head_dim = model_shape.head_dim(cfg)
        heads, groups, h = cfg.num_attention_heads, model_shape.query_groups(cfg), cfg.hidden_size
        split = inputs.ctx.tp.size if self.bottleneck else 1  # bottleneck: this rank's heads only
        self.heads, self.groups = heads // split, groups // split
        self.q = self._factor("q", h, heads * self.head_dim)
        self.k = self._factor("k", h, groups * self.head_dim)
        self.v = self._factor("v", h, groups * self.head_dim)
        self.proj = self._factor("proj", heads * self.head_dim, h, output=True)

    def _core(self, q, k, v, rope, layout) -> torch.Tensor:
        """Heads ``[s, b, n*d]``, ``[s, b, g*d]`` -> attention output ``[s, b, n*d]``."""
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads, self.head_dim)
        k, v = (t.view(s, b, self.groups, self.head_dim) for t in (k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if layout is not None and layout.needs_custom_attention:
            return context_attention(q, k, v, layout, attention_core)
        return attention_core(q, k, v)

    def _bottleneck_middle(self, z, rope, layout) -> torch.Tensor:
        """Summed q/k/v bottleneck ``[s, b, 3r]`` -> this rank's heads -> partial ``proj`` A ``[s, b, r]``."""
        return bottleneck_a(self._core(*bottleneck_b(z, [self.q, self.k, self.v]), rope, layout), [self.proj])

    def forward(self, x: torch.Tensor, rope=None, layout=None) -> torch.Tensor:
        if not self.bottleneck:
            q, k, v = naive_group(x, [self.q, self.k, self.v], self.group, sp_in=self.sp, sp_out=False)
            return naive_group(self._core(q, k, v, rope, layout), [self.proj], self.group, sp_in=False,
                               sp_out=self.sp)[0]
        z = self._normed_a(x, [self.q, self.k, self.v])
        z = bottleneck_all_reduce(self._run(self._bottleneck_middle, z, rope, layout), self.group)
        return self._output(z, self.proj)


class LowRankMLP(_LowRankModule):
    """MLP with low-rank projections: SwiGLU ``fc2(silu(gate) * up)`` or ``fc2(gelu(fc1))``.

    Forward: naive ``[s, b, h]`` (``[s/t, b, h]`` under SP) -> same; bottleneck ``[s, b, h/t]``
    -> ``[s, b, h/t]`` (its online norm included; the inner activation is ``[s, b, f/t]``).
    """

    norm_name = "post_attention_norm"

    def __init__(self, inputs, name: str) -> None:
        super().__init__(inputs, name)
        cfg = inputs.cfg
        h, f = cfg.hidden_size, model_shape.ffn_size(cfg)
        self.activation = cfg.activation
        self.inner_names = ("gate", "up") if cfg.activation == "swiglu" else ("fc1",)
        for n in self.inner_names:
            setattr(self, n, self._factor(n, h, f))
        self.fc2 = self._factor("fc2", f, h, output=True)

    def _act(self, parts) -> torch.Tensor:
        # activate() takes SwiGLU's [gate; up] concatenated along the last dim.
        return activate(self.activation, torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = [getattr(self, n) for n in self.inner_names]
        if not self.bottleneck:
            act = self._act(naive_group(x, inner, self.group, sp_in=self.sp, sp_out=False))
            return naive_group(act, [self.fc2], self.group, sp_in=False, sp_out=self.sp)[0]
        z = self._normed_a(x, inner)
        partial = self._run(lambda t: bottleneck_a(self._act(bottleneck_b(t, inner)), [self.fc2]), z)
        return self._output(bottleneck_all_reduce(partial, self.group), self.fc2)


def low_rank_attention(inputs, name: str) -> nn.Module:
    """The :class:`~paratron.models.layer_spec.TransformerLayerSpec` builder of :class:`LowRankAttention`."""
    return LowRankAttention(inputs, name)


def low_rank_mlp(inputs, name: str) -> nn.Module:
    """The :class:`~paratron.models.layer_spec.TransformerLayerSpec` builder of :class:`LowRankMLP`."""
    return LowRankMLP(inputs, name)
