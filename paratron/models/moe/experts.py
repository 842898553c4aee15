"""The experts held by one rank: independent MLPs run on their own rows.

Each expert is a dense MLP like :class:`paratron.models.mlp.MLP` (GELU: ``fc1 -> gelu -> fc2``;
SwiGLU: ``silu(gate) * up -> fc2``, Shazeer 2020), kept whole on its rank (expert-TP is 1). Its
parameters carry the expert's *global* id in their logical names, e.g.
``layers.3.mlp.experts.5.fc1.weight``, so checkpoints reshard across any expert-parallel size,
and every expert's full tensors are drawn from ``(seed, logical name)`` as in a single process.
They are marked ``is_expert=True``: their grads reduce over ``ctx.expert_dp``.

Weight grads come from plain autograd. An expert that gets no rows still runs its matmuls on an
empty ``[0, h]`` slice, so its params receive zero grads (not None) and every rank reports the
same params to DDP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig
from paratron.layers.init import InitMethod, draw_full, normal_, scaled_normal_
from paratron.parallel.params import mark

from .. import spec


def expert_ffn_size(cfg: ModelConfig) -> int:
    """Inner width of one expert: ``moe_ffn_hidden_size``, else the dense MLP width
    (:func:`paratron.models.spec.ffn_size`)."""
    return cfg.moe_ffn_hidden_size if cfg.moe_ffn_hidden_size is not None else spec.ffn_size(cfg)


class _Proj(nn.Module):
    """One expert linear ``[rows, in] -> [rows, out]``: weight ``[out, in]``, optional bias ``[out]``."""

    def __init__(self, in_f: int, out_f: int, ctx, *, logical_name: str, seed: int, bias: bool,
                 init: InitMethod, params_dtype: torch.dtype):
        super().__init__()
        full = draw_full(init, (out_f, in_f), seed, f"{logical_name}.weight")
        self.weight = nn.Parameter(full.to(device=ctx.device, dtype=params_dtype))
        mark(self.weight, f"{logical_name}.weight", is_expert=True)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_f, device=ctx.device, dtype=params_dtype))
            mark(self.bias, f"{logical_name}.bias", is_expert=True, no_weight_decay=True)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ExpertMLP(nn.Module):
    """One expert: ``[rows, h] -> [rows, h]``.

    Args:
        cfg: ``hidden_size``, ``activation``, ``add_bias_linear``, ``init_method_std``,
            ``num_layers``, ``moe_ffn_hidden_size``.
        ctx: the parallel context (device).
        logical_name: ``layers.{i}.mlp.experts.{e}`` with the global expert id ``e``.
        seed: the run's seed.
        params_dtype: parameter dtype.
    """

    def __init__(self, cfg: ModelConfig, ctx, *, logical_name: str, seed: int, params_dtype: torch.dtype):
        super().__init__()
        h, f = cfg.hidden_size, expert_ffn_size(cfg)
        self.activation = cfg.activation
        kw = dict(seed=seed, bias=cfg.add_bias_linear, params_dtype=params_dtype)
        inner = normal_(cfg.init_method_std)
        # GPT-2's scaled init of residual-branch outputs, as the dense MLP's fc2.
        outer = scaled_normal_(cfg.init_method_std, max(cfg.num_layers, 1))
        if cfg.activation == "swiglu":
            self.gate = _Proj(h, f, ctx, logical_name=f"{logical_name}.gate", init=inner, **kw)
            self.up = _Proj(h, f, ctx, logical_name=f"{logical_name}.up", init=inner, **kw)
        else:
            self.fc1 = _Proj(h, f, ctx, logical_name=f"{logical_name}.fc1", init=inner, **kw)
        self.fc2 = _Proj(f, h, ctx, logical_name=f"{logical_name}.fc2", init=outer, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            inner = F.silu(self.gate(x)) * self.up(x)
        else:
            approximate = "tanh" if self.activation == "gelu_tanh" else "none"
            inner = F.gelu(self.fc1(x), approximate=approximate)
        return self.fc2(inner)


class LocalExperts(nn.Module):
    """The ``num_local`` experts of this EP rank, global ids ``first_expert + l``.

    ``forward(x, tokens_per_expert)``: ``x`` is ``[N, h]`` rows, expert-major (the first
    ``tokens_per_expert[0]`` rows for local expert 0, ...); returns ``[N, h]`` in the same order.

    Raises:
        ValueError: ``tokens_per_expert`` has the wrong length or does not sum to ``N``.
    """

    def __init__(self, cfg: ModelConfig, ctx, *, prefix: str, seed: int, first_expert: int, num_local: int,
                 params_dtype: torch.dtype):
        super().__init__()
        self.first_expert = first_expert
        self.local = nn.ModuleList(
            ExpertMLP(cfg, ctx, logical_name=f"{prefix}.experts.{first_expert + l}", seed=seed,
                      params_dtype=params_dtype)
            for l in range(num_local))

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        if len(tokens_per_expert) != len(self.local) or sum(tokens_per_expert) != x.shape[0]:
            raise ValueError(f"LocalExperts: tokens_per_expert={tokens_per_expert} does not match "
                             f"{len(self.local)} local experts and {x.shape[0]} rows")
        # Empty slices still run, so idle experts get zero grads rather than None.
        outs = [expert(part) for expert, part in zip(self.local, torch.split(x, tokens_per_expert))]
        return torch.cat(outs) if outs else x
