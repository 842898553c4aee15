"""Example plugin: a token dispatcher of your own, ``sorted_local``.

With every expert on this rank (``parallel.expert=1``) a dispatcher needs no communication: it
orders the routed (token, slot) rows expert-major for the experts, and puts the expert outputs
back in (token, slot) order. The contract (:mod:`paratron.models.moe.dispatcher`):
``dispatch(tokens [T, h], indices [T, k]) -> (rows [N, h], rows per expert, plan)`` and
``combine(outputs [N, h], plan) -> [T, k, h]``, zero for dropped slots (index -1). Train with it::

    paratron train --set 'train.callbacks=["examples/plugins/custom_dispatcher.py:Registered"]' \\
        --set model.moe_token_dispatcher=sorted_local --set model.num_experts=4 ...
"""

from __future__ import annotations

import torch

from paratron.models.moe.dispatcher import TokenDispatcher, register_dispatcher
from paratron.training.callbacks import Callback


class SortedLocalDispatcher(TokenDispatcher):
    def __init__(self, ctx, num_experts: int, *, capacity=None, pad_to_capacity: bool = False):
        super().__init__(ctx, num_experts, capacity=capacity, pad_to_capacity=pad_to_capacity)
        if ctx.ep.size != 1 or pad_to_capacity:
            raise ValueError("sorted_local holds every expert on one rank: it needs parallel.expert=1 "
                             "and model.moe_pad_to_capacity=false")

    def dispatch(self, tokens: torch.Tensor, indices: torch.Tensor):
        flat = indices.reshape(-1)
        kept = torch.nonzero(flat >= 0).reshape(-1)
        slots = kept[torch.sort(flat[kept], stable=True).indices]  # by (expert, token, slot)
        counts = torch.bincount(flat[slots], minlength=self.num_experts).tolist()
        return tokens.index_select(0, slots // indices.shape[1]), counts, (slots, indices.shape)

    def combine(self, expert_output: torch.Tensor, plan) -> torch.Tensor:
        slots, (t, k) = plan
        out = expert_output.new_zeros(t * k, expert_output.shape[-1]).index_copy(0, slots, expert_output)
        return out.view(t, k, -1)


register_dispatcher("sorted_local", SortedLocalDispatcher)


class Registered(Callback):
    """Does nothing per step; naming it in ``train.callbacks`` imports this file on every rank
    (and in the launcher, before the config is checked), which registers the dispatcher."""
