"""The experts held by one rank: independent MLPs run on their own rows.

Each expert is a dense MLP like :class:`paratron.models.mlp.MLP` (GELU: ``fc1 -> gelu -> fc2``;
SwiGLU: ``silu(gate) * up -> fc2``, Shazeer 2020). Its parameters carry the expert's *global* id
in their logical names, e.g. ``layers.3.mlp.experts.5.fc1.weight``, so checkpoints reshard across
any expert-parallel size, and every expert's full tensors are drawn from ``(seed, logical name)``
as in a single process. They are marked ``is_expert=True``: their grads reduce over
``ctx.expert_dp``.

Expert tensor parallelism (``parallel.expert_tensor = etp > 1``) splits every expert over the
``ctx.expert_tp`` group like the dense MLP (Shoeybi et al. 2019, section 3): ``fc1``/``gate``/``up``
by output rows, ``fc2`` by input columns. The ranks of that group hold different tokens, so each
rank sends its dispatched rows to every rank of the group (an all-to-all with uneven splits),
every rank runs its slice of the experts on all of them, and the partial outputs go back to their
owner and are summed there (the reverse all-to-all). The ``fc2`` bias is added once, on the group's
first rank, and every replica receives the full bias grad.

The local experts can run together as grouped GEMMs (:mod:`.grouped_gemm`): each projection's
per-expert weights are stacked ``[E_local, in, out]`` at the start of the forward (SwiGLU's gate
and up side by side, ``[E_local, h, 2f]``) and the expert-major rows go through one grouped or
batched matmul. The parameters themselves stay one per expert and projection: they are the
source of truth for logical names, shard specs, checkpoints (old ones load unchanged, EP
resharding is unchanged) and the optimizer. The stack is a constant to autograd: the backward of
the grouped GEMM returns the input grad only and its weight grad goes to the params through
:func:`~paratron.parallel.grads.accumulate_grad`, like a linear layer's. The stack is a copy of
the local expert weights per forward (``E_local * h * f`` elements per projection), small next to
the ``N * h * f`` multiply-adds of the rows once experts hold more than a handful of tokens. An
expert that gets no rows receives zero grads (not None), so every rank reports the same params to
DDP (which lets DDP reduce expert buckets during backward).

Weight and bias grads, in both the loop (:func:`~paratron.layers.linear.local_linear` per
projection) and the grouped paths (``grouped_linear(..., weight_grad=)``,
``RowBias(..., bias_grad)``), are computed in the backward or, while the module's
``weight_grad_store`` is deferring, queued for the zero-bubble W action (Qi et al. 2023, section
2), by the same rule as the dense linears (:func:`~paratron.parallel.grads.run_or_defer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers.init import InitMethod, init_shard_, normal_, scaled_normal_
from paratron.layers.linear import local_linear
from paratron.parallel.comm import Group
from paratron.parallel.context import ParallelContext
from paratron.parallel.grads import accumulate_grad, run_or_defer
from paratron.parallel.mappings import all_to_all
from paratron.parallel.params import ShardSpec, mark

from ..mlp import gelu, swiglu
from .dispatcher import source_to_expert_major
from .grouped_gemm import METHODS, RowBias, grouped_linear


class _BiasOnce(torch.autograd.Function):
    """``x + bias`` on the first rank of the expert-TP group, ``x`` elsewhere (the partial outputs
    are summed afterwards); every rank gets ``sum(grad)`` as the bias grad, which is the full grad
    because the backward of that sum hands every rank the same output grads. The bias grad takes
    the linears' path (:func:`~paratron.parallel.grads.run_or_defer` on ``owner``)."""

    @staticmethod
    def forward(fctx, x, bias, first: bool, owner):
        fctx.bias, fctx.owner = bias, owner
        return x + bias if first else x.clone()

    @staticmethod
    def backward(fctx, grad):
        bias = fctx.bias
        run_or_defer(fctx.owner, lambda: accumulate_grad(bias, grad.sum(dim=0)))
        return grad, None, None, None


def _unstack(projs: list[list["_Proj"]], grad: torch.Tensor) -> None:
    """Hand the stacked weight grad ``[E_local, in, sum(out)]`` of the projections ``projs[e]``
    (side by side along ``out``) to each param, in its ``[out, in]`` layout."""
    for e, ps in enumerate(projs):
        start = 0
        for p in ps:
            n = p.weight.shape[0]
            accumulate_grad(p.weight, grad[e, :, start:start + n].t().contiguous())
            start += n


def _unstack_bias(projs: list[list["_Proj"]], grad: torch.Tensor) -> None:
    """Hand the stacked bias grad ``[E_local, sum(out)]`` to each projection's bias ``[out]``."""
    for e, ps in enumerate(projs):
        for p, g in zip(ps, torch.split(grad[e], [p.bias.shape[0] for p in ps])):
            accumulate_grad(p.bias, g.contiguous())


class _Proj(nn.Module):
    """One expert linear ``[rows, in] -> [rows, out]``: weight ``[out, in]``, optional bias ``[out]``,
    split over the expert-TP group along ``split`` ("out": rows of the weight, "in": columns,
    None: whole)."""

    def __init__(self, in_f: int, out_f: int, ctx: ParallelContext, *, logical_name: str, seed: int, bias: bool,
                 init: InitMethod, params_dtype: torch.dtype, split: str | None = None):
        super().__init__()
        etp, r = ctx.expert_tp.size, ctx.expert_tp.rank
        self.split, self.first = split if etp > 1 else None, r == 0
        if self.split == "out":
            n = out_f // etp
            spec = ShardSpec((out_f, in_f), (r * n, 0), (n, in_f))
        elif self.split == "in":
            n = in_f // etp
            spec = ShardSpec((out_f, in_f), (0, r * n), (out_f, n))
        else:
            spec = ShardSpec.replicated((out_f, in_f))
        weight = torch.empty(spec.local_shape, device=ctx.device, dtype=params_dtype)
        self.weight = nn.Parameter(init_shard_(weight, init, spec, seed, f"{logical_name}.weight"))
        mark(self.weight, f"{logical_name}.weight", spec, partition_dim={"out": 0, "in": 1}.get(self.split, -1),
             is_expert=True)
        if bias:
            n = out_f // etp if self.split == "out" else out_f
            self.bias = nn.Parameter(torch.zeros(n, device=ctx.device, dtype=params_dtype))
            bspec = ShardSpec((out_f,), (r * n,), (n,)) if self.split == "out" else None
            mark(self.bias, f"{logical_name}.bias", bspec, partition_dim=0 if self.split == "out" else -1,
                 is_expert=True, no_weight_decay=True)
        else:
            self.register_parameter("bias", None)

        self.weight_grad_store = None  # set by the pipeline runtime (zero-bubble W actions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split == "in" and self.bias is not None:
            return _BiasOnce.apply(local_linear(x, self.weight, None, self), self.bias, self.first, self)
        return local_linear(x, self.weight, self.bias, self)


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

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, logical_name: str, seed: int,
                 params_dtype: torch.dtype):
        super().__init__()
        h, f = cfg.hidden_size, model_shape.expert_ffn_size(cfg)
        self.activation = cfg.activation
        kw = dict(seed=seed, bias=cfg.add_bias_linear, params_dtype=params_dtype)
        inner = normal_(cfg.init_method_std)
        # GPT-2's scaled init of residual-branch outputs, as the dense MLP's fc2.
        outer = scaled_normal_(cfg.init_method_std, max(cfg.num_layers, 1))
        if cfg.activation == "swiglu":
            self.gate = _Proj(h, f, ctx, logical_name=f"{logical_name}.gate", init=inner, split="out", **kw)
            self.up = _Proj(h, f, ctx, logical_name=f"{logical_name}.up", init=inner, split="out", **kw)
        else:
            self.fc1 = _Proj(h, f, ctx, logical_name=f"{logical_name}.fc1", init=inner, split="out", **kw)
        self.fc2 = _Proj(f, h, ctx, logical_name=f"{logical_name}.fc2", init=outer, split="in", **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            return self.fc2(swiglu(self.gate(x), self.up(x)))
        return self.fc2(gelu(self.fc1(x), self.activation))

    def with_weights(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """This expert's function on rows ``x [n, h]`` with the weights ``w`` (by parameter name,
        e.g. ``"fc1.weight"``) in place of its own: ``[n, h]``, differentiable in ``w`` through
        autograd (the prefetch dispatcher's fetched copies, :mod:`.prefetch`). Whole experts only
        (no expert-TP)."""
        def linear(name: str, inp: torch.Tensor) -> torch.Tensor:
            return F.linear(inp, w[f"{name}.weight"], w.get(f"{name}.bias"))

        if self.activation == "swiglu":
            return linear("fc2", swiglu(linear("gate", x), linear("up", x)))
        return linear("fc2", gelu(linear("fc1", x), self.activation))


class LocalExperts(nn.Module):
    """The ``num_local`` experts of this EP rank, global ids ``first_expert + l`` (each split over
    ``ctx.expert_tp`` when it is larger than 1, see the module docstring).

    ``forward(x, tokens_per_expert)``: ``x`` is ``[N, h]`` rows, expert-major (the first
    ``tokens_per_expert[0]`` rows for local expert 0, ...); returns ``[N, h]`` in the same order.
    ``gemm`` picks how the experts run (:data:`.grouped_gemm.METHODS`): ``"grouped_mm"`` /
    ``"bmm"`` as grouped GEMMs over stacked weights, ``"loop"`` as each ``ExpertMLP`` of
    ``local`` on its own rows (the per-expert reference); ``"auto"`` (default) is the grouped
    choice of :func:`.grouped_gemm.choose_method` on CUDA and the loop on CPU, where it measured
    fastest.

    Raises:
        ValueError: ``tokens_per_expert`` has the wrong length or does not sum to ``N``; an
            unknown ``gemm``.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, prefix: str, seed: int, first_expert: int,
                 num_local: int,
                 params_dtype: torch.dtype, gemm: str = "auto"):
        super().__init__()
        if gemm not in METHODS:
            raise ValueError(f"LocalExperts: unknown gemm {gemm!r}; one of {METHODS}")
        self.first_expert, self.gemm, self.activation = first_expert, gemm, cfg.activation
        self.etp: Group = ctx.expert_tp
        self.weight_grad_store = None  # set by the pipeline runtime (zero-bubble W actions)
        self.local = nn.ModuleList(
            ExpertMLP(cfg, ctx, logical_name=f"{prefix}.experts.{first_expert + i}", seed=seed,
                      params_dtype=params_dtype)
            for i in range(num_local))

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        if len(tokens_per_expert) != len(self.local) or sum(tokens_per_expert) != x.shape[0]:
            raise ValueError(f"LocalExperts: tokens_per_expert={tokens_per_expert} does not match "
                             f"{len(self.local)} local experts and {x.shape[0]} rows")
        if self.etp.size > 1:
            return self._expert_tp_forward(x, tokens_per_expert)
        return self._run(x, tokens_per_expert)

    def _projection(self, names: tuple[str, ...], x: torch.Tensor, counts: list[int],
                    row_expert: torch.Tensor, method: str) -> torch.Tensor:
        """The projections ``names`` of every local expert (side by side along the output) on
        their rows: weights stacked ``[E_local, in, sum(out)]``, one grouped GEMM."""
        projs = [[getattr(e, n) for n in names] for e in self.local]
        with torch.no_grad():  # a constant to autograd: its grad goes to the params themselves
            weight = torch.stack([torch.cat([p.weight for p in ps]) for ps in projs]).transpose(1, 2)
        # The stacked weight grad is computed in B, or queued for the W action, like a linear's.
        y = grouped_linear(x, weight, counts, method,
                           weight_grad=lambda compute: run_or_defer(self, lambda: _unstack(projs, compute())))
        first = projs[0][0]
        if first.bias is None:
            return y
        with torch.no_grad():
            bias = torch.stack([torch.cat([p.bias for p in ps]) for ps in projs])
        return RowBias.apply(y, bias, row_expert, first.split != "in" or first.first,
                             lambda compute: run_or_defer(self, lambda: _unstack_bias(projs, compute())))

    def _run(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        if not len(self.local):
            return x
        counts, method = tokens_per_expert, self.gemm
        if method == "auto" and not x.is_cuda:
            # On CPU, torch._grouped_mm and the padded bmm measured slower than one F.linear per
            # expert (benchmarks/README.md, "Grouped expert GEMMs"), so the loop stays the default.
            method = "loop"
        if method == "loop":
            # Empty slices still run, so idle experts get zero grads rather than None.
            return torch.cat([e(part) for e, part in zip(self.local, torch.split(x, counts))])
        row_expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device),
                                             torch.tensor(counts, device=x.device))
        if self.activation == "swiglu":
            gate, up = self._projection(("gate", "up"), x, counts, row_expert, method).chunk(2, dim=-1)
            hidden = swiglu(gate, up)
        else:
            hidden = gelu(self._projection(("fc1",), x, counts, row_expert, method), self.activation)
        return self._projection(("fc2",), hidden, counts, row_expert, method)

    def _expert_tp_forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        g, n = self.etp, x.shape[0]
        mine = torch.tensor(tokens_per_expert, dtype=torch.int64, device=x.device)
        counts = g.all_gather(mine.reshape(1, -1), 0)  # [etp, E_local]
        rows = counts.sum(dim=1).tolist()
        # Every rank of the group gets every rank's rows, grouped [source rank][local expert].
        gathered = all_to_all(x.repeat(g.size, 1), g, rows, [n] * g.size)
        perm = source_to_expert_major(counts)
        partial = self._run(gathered.index_select(0, perm), counts.sum(dim=0).tolist())
        source_major = partial.new_zeros(partial.shape).index_copy(0, perm, partial)
        # Each owner receives the partial outputs of its rows from every rank and sums them.
        back = all_to_all(source_major, g, [n] * g.size, rows)
        return back.view(g.size, n, x.shape[-1]).sum(dim=0)
