"""Balanced routing: the dry run's stand-in for data-dependent MoE routing.

A real router's choice decides tensor sizes (rows per expert, the splits of the uneven
all-to-all), and ``bincount`` / ``nonzero`` / ``.tolist()`` have no meta kernel. The dry run
therefore routes by a fixed rule that needs no data: slot ``j`` of token ``t`` goes to expert
``(t * k + j) mod E`` (the ``k`` experts of a token are distinct while ``k <= E``). Every expert
then gets ``floor(T k / E)`` or one more of a rank's ``T k`` pairs, the perfectly balanced load
the auxiliary losses and the expert bias aim at, so the figures are those of a balanced step:

* the rows per expert and the all-to-all splits are computed on the host from that rule, and the
  row all-to-alls carry exactly the bytes the real dispatcher would for the same choice (the
  test runs the real dispatcher on real tensors with :func:`balanced_choice` and compares the
  ledgers);
* imbalance (a hot expert's extra rows and activations) is not modelled;
* dropping over capacity (``model.moe_capacity_factor``), the all-gather dispatcher and expert
  tensor parallelism (``parallel.expert_tensor > 1``) read the data again and are refused.

Seams used in the real code: ``TopKRouter.choose`` and ``TopKRouter.count_experts`` (set per
router instance) and ``MoELayer.dispatcher_cls`` (a subclass of the configured all-to-all
dispatcher whose sort and count exchange use the host counts).
"""

from __future__ import annotations

import torch
from torch import nn

from paratron.models.moe.dispatcher import AllToAllDispatcher, _Sorted
from paratron.models.moe.layer import MoELayer


def balanced_choice(num_experts: int, k: int, scores: torch.Tensor) -> torch.Tensor:
    """Expert ids ``[T, k]`` (int64, on ``scores``' device): ``(t * k + j) mod E``."""
    T = scores.shape[0]
    slots = torch.arange(T * k, device=scores.device, dtype=torch.int64)
    return (slots % num_experts).view(T, k)


def balanced_counts(num_slots: int, num_experts: int) -> torch.Tensor:
    """Pairs per expert ``[E]`` (int64, host) under :func:`balanced_choice` for ``num_slots = T k``."""
    base, extra = divmod(num_slots, num_experts)
    return torch.tensor([base + (e < extra) for e in range(num_experts)], dtype=torch.int64)


class BalancedRowsMixin:
    """Put before an :class:`AllToAllDispatcher` subclass: the sort and the count exchange of a
    meta dispatch follow :func:`balanced_choice` on the host (the row all-to-alls still run)."""

    def _sort(self, tokens: torch.Tensor, indices: torch.Tensor) -> _Sorted:
        T, k = indices.shape
        n = T * k
        # Pairs sorted by expert: the order only permutes rows, which meta tensors do not hold.
        slot_ids = torch.arange(n, device=tokens.device)
        rows = tokens.index_select(0, torch.div(slot_ids, k, rounding_mode="floor"))
        counts = balanced_counts(n, self.num_experts)
        return _Sorted(n, k, slot_ids, torch.arange(n, device=tokens.device), rows,
                       counts.view(self.group.size, self.num_local))

    def _exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """Every source rank uses the same rule on the same number of tokens, so each sends this
        rank's experts the same counts; the exchange itself still runs (its bytes are counted)."""
        dev = self.ctx.device
        self.group.all_to_all(torch.empty(send_counts.shape, dtype=torch.int64, device=dev),
                              torch.empty(send_counts.shape, dtype=torch.int64, device=dev))
        mine = send_counts[self.group.rank]
        return mine.expand(self.group.size, -1).clone()


def check_supported(cfg) -> str | None:
    """Why the balanced stand-in cannot serve ``cfg`` (a model with experts), or None."""
    m, p = cfg.model, cfg.parallel
    if m.moe_capacity_factor is not None:
        return f"model.moe_capacity_factor={m.moe_capacity_factor} (dropping over capacity reads the routing)"
    if p.expert_tensor > 1:
        return f"parallel.expert_tensor={p.expert_tensor} (the expert-TP row exchange reads the counts)"
    if m.moe_token_dispatcher == "prefetch":
        return ("model.moe_token_dispatcher='prefetch' (its pull-or-push choice reads the routing "
                "history; use 'alltoall' for the dry run)")
    if m.moe_top_k > m.num_experts:
        return f"model.moe_top_k={m.moe_top_k} > model.num_experts={m.num_experts}"
    return None


def moe_layers_of(chunks: list[nn.Module]) -> list[MoELayer]:
    return [mod for chunk in chunks for mod in chunk.modules() if isinstance(mod, MoELayer)]


def install_balanced_routing(chunks: list[nn.Module], *, meta: bool) -> int:
    """Route every MoE layer of ``chunks`` by :func:`balanced_choice`; with ``meta``, also count
    and dispatch on the host (:class:`BalancedRowsMixin`). Returns the number of MoE layers.

    Raises:
        ValueError: a layer's dispatcher is not an all-to-all dispatcher.
    """
    layers = moe_layers_of(chunks)
    for layer in layers:
        router = layer.router
        router.choose = lambda scores, E=router.num_experts, k=router.k: balanced_choice(E, k, scores)
        if not meta:
            continue
        if not issubclass(layer.dispatcher_cls, AllToAllDispatcher):
            raise ValueError(f"dispatcher {layer.dispatcher_cls.__name__}: the dry run's balanced stand-in "
                             "serves all-to-all dispatchers only")
        router.count_experts = lambda indices, E=router.num_experts, k=router.k: torch.full(
            (E,), indices.shape[0] * k / E, device=indices.device)
        layer.dispatcher_cls = type(f"Balanced{layer.dispatcher_cls.__name__}",
                                    (BalancedRowsMixin, layer.dispatcher_cls), {})
    return len(layers)
