"""Mixture of experts and expert parallelism.

Modules: :mod:`.router` (top-k routing, aux and z losses, capacity), :mod:`.dispatcher` (token
dispatchers and their registry), :mod:`.experts` (the experts of one rank), :mod:`.collectives`
(autograd-aware all-to-all, all-gather, reduce-scatter) and :mod:`.layer` (:class:`MoELayer`).
MoE FLOPs (active experts only) are counted by :mod:`paratron.models.flops`. Nothing is imported
here, so one broken module only breaks what uses it.
"""
