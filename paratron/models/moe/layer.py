"""The mixture-of-experts MLP: router -> token dispatch -> local experts -> combine (+ shared expert).

Sources: Shazeer et al. 2017 (sparsely-gated MoE); Lepikhin et al. 2020, GShard (section 2:
top-2 gating, expert parallelism with all-to-all); Fedus et al. 2021, Switch Transformers
(capacity factor, aux loss); Zoph et al. 2022, ST-MoE (router z-loss); Rajbhandari et al. 2022,
DeepSpeed-MoE (shared expert, section 4.1 "Residual-MoE").

How the layout maps onto the tokens:

* **EP.** The EP ranks are data-parallel ranks of the dense grid: each routes its own tokens and
  the dispatcher sends every (token, slot) to the rank holding its expert.
* **TP with sequence parallelism.** The input is ``[s/tp, b, h]``: each TP rank routes and
  dispatches its own positions. The router weight is marked ``sequence_parallel`` (its grads are
  summed over TP). The per-expert counts of the microbatch are gathered over TP, so the aux loss
  and the capacity decisions are those of the whole microbatch.
* **TP without sequence parallelism.** The input ``[s, b, h]`` is the same on every TP rank. Each
  TP rank routes all tokens (same result everywhere, so the router grads are equal without a
  reduction) but dispatches only its 1/tp of them; the per-slot expert outputs are all-gathered
  over TP and combined everywhere. So each token passes its experts once, and the expert grads,
  summed over ``expert_dp``, count each token once.
* **Expert-TP** (``parallel.expert_tensor``): each expert is split over ``ctx.expert_tp``; the
  ranks of that group exchange their dispatched rows (see :mod:`.experts`).

The aux and z losses reach the backward without changing the layer output: an identity autograd
function on the output adds ``aux_loss_scale * (aux_coeff * aux + z_coeff * z)`` to the loss being
differentiated (the idea of Megatron-LM's ``MoEAuxLossAutoScaler``). The training step sets
``aux_loss_scale`` (:func:`set_aux_loss_scale`) to ``1 / (number of microbatches in the global
batch, over all DP ranks)``: the LM loss is divided by the global token count and DDP sums the
grads, so the aux-loss grad then equals ``coeff *`` the mean over microbatches of the per-
microbatch aux-loss grad, the same under every layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config import ModelConfig, model_shape
from paratron.layers.init import init_shard_, normal_, scaled_normal_
from paratron.parallel.context import ParallelContext
from paratron.parallel.mappings import gather_along_dim, split_along_dim
from paratron.parallel.params import ShardSpec, mark

from ..mlp import MLP
from .dispatcher import check_dispatcher_config, get_dispatcher
from .experts import LocalExperts
from .router import TopKRouter, drop_by_score, drop_over_capacity, expert_capacity


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out``; in backward, hands ``scale`` as the grad of the scalar ``aux``."""

    @staticmethod
    def forward(fctx, out, aux, scale: float):
        fctx.scale = scale
        fctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out

    @staticmethod
    def backward(fctx, grad):
        shape, dtype, device = fctx.aux_meta
        return grad, torch.full(shape, fctx.scale, dtype=dtype, device=device), None


class MoELayer(nn.Module):
    """Mixture-of-experts MLP for transformer layer ``layer_number``.

    Args:
        cfg: the model config: ``num_experts``, ``moe_top_k``, ``moe_router_score``,
            ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``, ``moe_capacity_factor`` (None:
            dropless), ``moe_token_drop_policy``, ``moe_pad_to_capacity``, the router options
            (expert bias, groups), ``moe_ffn_hidden_size``,
            ``moe_shared_expert_ffn_hidden_size``, ``moe_shared_expert_gate`` (``y += sigmoid(x .
            w_gate) * shared(x)``, weight ``layers.{i}.mlp.shared_expert_gate.weight`` ``[1, h]``),
            ``moe_token_dispatcher``, plus the dense sizes.
        ctx: the parallel context (groups ``tp``, ``ep``; expert params reduce over ``expert_dp``).
        layer_number: the global (0-based) layer index; params are named ``layers.{i}.mlp.*``.
        seed: the run's seed (full tensors drawn from ``(seed, logical name)``).
        sequence_parallel: activations are split along the sequence over TP.
        params_dtype: parameter dtype (router logits and combine weights stay fp32).

    ``forward(x)``: ``x`` is ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); returns
    the same shape and layout. The rows of a microbatch are its ``s * b`` tokens, sequence-major.

    Attributes:
        last_aux_loss: the last forward's aux loss of the whole microbatch (Switch eq. 4, without
            the coefficient; 1.0 when perfectly balanced), a detached 0-dim fp32 tensor.
        last_z_loss: the same for the router z-loss.
        aux_loss_scale: multiplies the aux/z-loss grads (see the module docstring); default 1.0.

    Raises:
        ValueError: ``model.num_experts`` not positive; in ``forward``, without sequence
            parallelism, ``s * b`` not divisible by ``parallel.tensor``.
        ConfigError: a rule of :func:`paratron.config.model_shape.check_moe`; an unknown
            ``model.moe_token_dispatcher`` or a rule of that dispatcher
            (:func:`.dispatcher.check_dispatcher_config`).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, *, layer_number: int, seed: int,
                 sequence_parallel: bool,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        E, ep = cfg.num_experts, ctx.ep.size
        if E < 1:
            raise ValueError(f"model.num_experts={E} must be >= 1 for an MoE layer")
        model_shape.check_moe(cfg, tp=ctx.tp.size, ep=ep, expert_tp=ctx.expert_tp.size)
        self.cfg, self.ctx = cfg, ctx
        self.sequence_parallel = bool(sequence_parallel) and ctx.tp.size > 1
        prefix = f"layers.{layer_number}.mlp"
        self.router = TopKRouter(cfg, ctx, logical_name=f"{prefix}.router", seed=seed,
                                 sequence_parallel=self.sequence_parallel, params_dtype=params_dtype)
        num_local = E // ep
        self.experts = LocalExperts(cfg, ctx, prefix=prefix, seed=seed, first_expert=ctx.ep.rank * num_local,
                                    num_local=num_local, params_dtype=params_dtype, gemm=cfg.moe_expert_gemm)
        self.pad_to_capacity = bool(cfg.moe_pad_to_capacity)
        check_dispatcher_config(cfg)
        self.dispatcher_cls = get_dispatcher(cfg.moe_token_dispatcher)
        self.dispatcher_options = getattr(self.dispatcher_cls, "options", lambda cfg: {})(cfg)
        # A dispatcher that keeps state across forwards (the prefetch dispatcher's routing window
        # and in-flight weight fetch) makes it here; it is handed to every forward's dispatcher.
        make_state = getattr(self.dispatcher_cls, "layer_state", None)
        self.dispatcher_state = make_state(cfg, ctx, self.experts) if make_state is not None else None
        if self.dispatcher_state is not None:
            self.dispatcher_options = {**self.dispatcher_options, "state": self.dispatcher_state}
        calls = getattr(self.dispatcher_cls, "expert_calls", lambda cfg: 1)(cfg)
        for p in self.experts.parameters():
            # The experts' weights get one grad per call in backward: DDP waits for all of them
            # before reducing inside the last backward (paratron.optim.ddp, meta.grad_uses).
            p.meta.grad_uses = calls
        self.shared_expert = None
        if cfg.moe_shared_expert_ffn_hidden_size:
            # DeepSpeed-MoE's residual expert (Rajbhandari et al. 2022, section 4.1): a dense MLP
            # run on every token, split over TP like the dense MLP.
            self.shared_expert = MLP(cfg, ctx, logical_name=f"{prefix}.shared_expert",
                                     ffn=cfg.moe_shared_expert_ffn_hidden_size, seed=seed,
                                     sequence_parallel=self.sequence_parallel, params_dtype=params_dtype,
                                     output_init=scaled_normal_(cfg.init_method_std, max(cfg.num_layers, 1)))
        self.shared_expert_gate = None
        if cfg.moe_shared_expert_gate:
            # Qwen2-MoE's per-token gate on the shared expert: weight [1, h], replicated like the router.
            shape, name = (1, cfg.hidden_size), f"{prefix}.shared_expert_gate.weight"
            gate = torch.empty(shape, device=ctx.device, dtype=params_dtype)
            self.shared_expert_gate = nn.Parameter(init_shard_(gate, normal_(cfg.init_method_std),
                                                               ShardSpec.replicated(shape), seed, name))
            mark(self.shared_expert_gate, f"{prefix}.shared_expert_gate.weight",
                 sequence_parallel=self.sequence_parallel)
        self.aux_loss_scale = 1.0
        # Set by the pipeline runtime during the forward half of an FB pair: the dispatcher calls
        # it after launching each all-to-all asynchronously (see TokenDispatcher.while_in_flight).
        self.while_in_flight = None
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None

    def _dispatcher(self, capacity: int | None):
        return self.dispatcher_cls(self.ctx, self.cfg.num_experts, capacity=capacity,
                                   pad_to_capacity=self.pad_to_capacity, **self.dispatcher_options)

    def before_attention(self) -> None:
        """Called by the transformer layer before its attention: lets a stateful dispatcher start
        work that the attention can hide (the prefetch dispatcher launches its weight fetch)."""
        start = getattr(self.dispatcher_state, "before_attention", None)
        if start is not None:
            start()

    takes_layout = True
    """The transformer layer hands :meth:`forward` the microbatch's sequence layout."""

    def _stats_group(self):
        """The ranks that hold the other tokens of this microbatch: TP (under SP) x CP."""
        cp = self.ctx.cp.size > 1
        if self.sequence_parallel:
            return self.ctx.tp_cp if cp else self.ctx.tp
        return self.ctx.cp if cp else None

    def _segments(self, s: int, b: int, layout) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(sequence id of each row [s*b], sequence lengths) for the sequence-level aux loss."""
        if self.cfg.moe_aux_loss_type != "seq":
            return None
        tp, device = self.ctx.tp, self.router.weight.device
        if layout is None:  # one rank holds whole sequences (up to SP): each sample is a sequence
            full = s * (tp.size if self.sequence_parallel else 1)
            ids = torch.arange(b, device=device).repeat(s)
            return ids, torch.full((b,), full, device=device)
        ids, lengths = layout.segment_ids(device)  # [s_cp, b]
        if self.sequence_parallel:
            ids = ids[tp.rank * s:(tp.rank + 1) * s]
        return ids.reshape(-1), lengths

    def forward(self, x: torch.Tensor, layout=None) -> torch.Tensor:
        """``x`` ``[s, b, h]`` (``[s/tp, b, h]`` under SP); ``layout`` the microbatch's
        :class:`~paratron.models.context_parallel.SeqLayout` (context parallelism, packed
        documents) or None."""
        cfg, tp = self.cfg, self.ctx.tp
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens, self._stats_group(), self._segments(s, b, layout))
        indices = routing.indices
        capacity = None
        if cfg.moe_capacity_factor is not None:
            capacity = expert_capacity(routing.num_tokens, cfg.num_experts, cfg.moe_top_k,
                                       cfg.moe_capacity_factor)
            if cfg.moe_token_drop_policy == "probs":
                indices = drop_by_score(indices, routing.scores, capacity, self._stats_group())
            else:
                indices = drop_over_capacity(indices, capacity, routing.counts_before)

        replicated = not self.sequence_parallel and tp.size > 1
        if replicated:
            if (s * b) % tp.size:
                raise ValueError(f"MoE without sequence parallelism splits the s*b={s * b} tokens of a "
                                 f"microbatch over parallel.tensor={tp.size}; they must divide")
            n = s * b // tp.size
            d_tokens, d_indices = split_along_dim(tokens, tp, 0), indices[tp.rank * n:(tp.rank + 1) * n]
        else:
            d_tokens, d_indices = tokens, indices

        dispatcher = self._dispatcher(capacity)
        dispatcher.while_in_flight = self.while_in_flight
        slots = dispatcher.run(d_tokens, d_indices, self.experts)  # [T_d, k, h]
        if replicated:
            slots = gather_along_dim(slots, tp, 0, grad_is_partial=False)
        y = (slots.float() * routing.probs.unsqueeze(-1)).sum(dim=1).to(x.dtype)

        self.last_aux_loss, self.last_z_loss = routing.aux_value, routing.z_value
        ca, cz = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
        if (ca or cz) and torch.is_grad_enabled():
            y = _AttachAuxLoss.apply(y, ca * routing.aux_loss + cz * routing.z_loss, float(self.aux_loss_scale))
        y = y.view(s, b, h)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared
            y = y + shared
        return y


def moe_layers(module: nn.Module) -> list[MoELayer]:
    """Every :class:`MoELayer` inside ``module`` (a model chunk or a list of chunks)."""
    modules = module if isinstance(module, (list, tuple)) else [module]
    return [m for chunk in modules for m in chunk.modules() if isinstance(m, MoELayer)]


def link_moe_layers(module: nn.Module) -> None:
    """Tell each MoE layer of ``module`` (a model chunk) which MoE layer runs before it in the
    same chunk (None for the first): a stateful dispatcher's ``link(previous state)`` (the
    prefetch dispatcher predicts a layer's hot experts from the layer before's routing)."""
    previous = None
    for m in moe_layers(module):
        link = getattr(m.dispatcher_state, "link", None)
        if link is not None:
            link(previous.dispatcher_state if previous is not None else None)
        previous = m


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Set ``aux_loss_scale`` on every MoE layer of ``module``; call it with ``1 / (number of
    microbatches in the global batch, over all DP ranks)`` before the step's forwards.

    Raises:
        ValueError: ``scale`` is negative.
    """
    if scale < 0:
        raise ValueError(f"aux loss scale must be >= 0, got {scale}")
    for m in moe_layers(module):
        m.aux_loss_scale = float(scale)


def aux_losses(module: nn.Module) -> dict[str, float]:
    """The last forward's aux and z losses averaged over the MoE layers of ``module`` (empty when
    it has none or none has run), for the training log: ``{"moe_aux_loss": .., "moe_z_loss": ..}``."""
    ran = [m for m in moe_layers(module) if m.last_aux_loss is not None]
    if not ran:
        return {}
    return {"moe_aux_loss": float(torch.stack([m.last_aux_loss for m in ran]).mean()),
            "moe_z_loss": float(torch.stack([m.last_z_loss for m in ran]).mean())}


def update_expert_bias(module: nn.Module, ctx: ParallelContext) -> None:
    """After a training step: move every router's expert bias (``model.moe_router_enable_expert_bias``)
    against its load error over the global batch. The per-expert loads of all MoE layers of this
    rank are summed in one all-reduce over ``ctx.dp_cp`` (and TP under sequence parallelism, where
    the TP ranks route different tokens), so every replica applies the same update.
    """
    routers = [m.router for m in moe_layers(module) if m.router.expert_bias is not None]
    if not routers:
        return
    loads = torch.stack([r.step_load for r in routers])  # [layers, E]
    ctx.dp_cp.all_reduce(loads)
    if routers[0].sequence_parallel:
        ctx.tp.all_reduce(loads)
    for router, load in zip(routers, loads):
        router.update_bias(load)
