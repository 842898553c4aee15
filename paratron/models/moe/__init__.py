"""Mixture of experts and expert parallelism.

Modules: :mod:`.router` (top-k routing, aux and z losses, capacity), :mod:`.dispatcher` (token
dispatchers and their registry), :mod:`.experts` (the experts of one rank), :mod:`.collectives`
(the in-flight, asynchronous all-to-all of the overlapped dispatchers; the synchronous
collectives with their adjoints are :mod:`paratron.parallel.mappings`) and :mod:`.layer`
(:class:`MoELayer`).
MoE FLOPs (active experts only) are counted by :mod:`paratron.models.flops`. Nothing is imported
here, so one broken module only breaks what uses it.
"""
