"""One path for weight gradients, shared by the linear layers, DDP and the zero-bubble runtime.

Linear layers do not return weight grads to autograd. They call :func:`accumulate_grad`, either at
once in their backward or later, when a zero-bubble schedule runs the deferred W action: the
layer then pushes a closure into its :class:`WeightGradStore` (Qi et al. 2023, section 2: the
backward is split into B, the input grad, and W, the weight grad).

:func:`accumulate_grad` adds into ``param.meta.main_grad`` when DDP has attached one (an fp32 view
into its grad buffer; with ZeRO-2/3 ``param.meta.acquire_main_grad(param)`` returns one, staged on
demand), else into ``param.grad``, then calls ``param.meta.grad_ready_hook(param)`` if DDP set
one, so that bucket reductions can start (overlap).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch

from .context import ParallelContext
from .params import meta_of


def _main_grad(param: torch.Tensor, meta) -> torch.Tensor | None:
    """DDP's fp32 accumulator of ``param`` (staged on demand under ZeRO-2/3), or None."""
    main = meta.main_grad
    if main is None and meta.acquire_main_grad is not None:
        main = meta.acquire_main_grad(param)
    return main


def _addmm_into_impl(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    out.addmm_(a, b)


def _addmm_into_fake(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    return None


# ``out += a @ b`` in place, as ``paratron::addmm_into``. Traced by ``torch.compile``
# (``model.compile``), a plain ``addmm_`` into a tensor the graph does not own becomes an
# out-of-place ``addmm`` and a copy back (one more ``[out, in]`` write and read per linear per
# microbatch); an op that declares its mutation is kept in place by the compiler. Defined with
# the low-level ``torch.library.Library`` rather than ``torch.library.custom_op``: the latter adds
# Python kernels for the autograd and in-place-view keys, ~15 us a call against ~3 for this one,
# which runs with grad mode off (64 calls a step at the main job's layout (1)).
_LIB = torch.library.Library("paratron", "DEF")
_LIB.define("addmm_into(Tensor(a!) out, Tensor a, Tensor b) -> ()")
_LIB.impl("addmm_into", _addmm_into_impl, "CompositeExplicitAutograd")
torch.library.register_fake("paratron::addmm_into", _addmm_into_fake, lib=_LIB)
_addmm_into = torch.ops.paratron.addmm_into.default


@torch.no_grad()
def accumulate_matmul_grad(param: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """:func:`accumulate_grad` of ``a @ b`` (``a [out, k]``, ``b [k, in]``, a 2-D ``param``):
    into an fp32 ``main_grad`` of the same dtype as one ``addmm`` that accumulates in place, so
    no ``[out, in]`` temporary is written and read back; else as :func:`accumulate_grad`."""
    meta = meta_of(param)
    main = _main_grad(param, meta)
    if main is None or main.dtype != a.dtype or main.dtype != b.dtype:
        accumulate_grad(param, a @ b)
        return
    target = main.view(a.shape[0], b.shape[1])
    if torch.compiler.is_compiling():
        _addmm_into(target, a, b)
    else:
        target.addmm_(a, b)
    if meta.grad_ready_hook is not None:
        meta.grad_ready_hook(param)


@torch.no_grad()
def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to the param's accumulator (``main_grad`` or ``.grad``) and notify DDP.

    Runs without autograd: a deferred W action executes outside the backward pass, where its
    inputs may still require grad."""
    meta = meta_of(param)
    main = _main_grad(param, meta)
    if main is not None:
        main.add_(grad.view_as(main))
    elif param.grad is None:
        param.grad = grad.detach().to(param.dtype).clone()
    else:
        param.grad.add_(grad.to(param.grad.dtype))
    if meta.grad_ready_hook is not None:
        meta.grad_ready_hook(param)


def run_or_defer(owner, compute: Callable[[], None]) -> None:
    """Run ``compute`` (a weight-grad computation ending in :func:`accumulate_grad`) now, or queue
    it in ``owner.weight_grad_store`` when that store is deferring (inside a zero-bubble ``B``).

    The one rule for every layer that defers weight grads (paratron's linears, the MoE experts).
    Read at backward time: the pipeline runtime toggles ``deferring`` between microbatches."""
    store = getattr(owner, "weight_grad_store", None)
    if store is not None and store.deferring:
        store.put(compute)
    else:
        compute()


def attach_weight_grad_store(module: torch.nn.Module, store: "WeightGradStore") -> None:
    """Give every submodule of ``module`` that defers weight grads (a ``weight_grad_store``
    attribute, read by :func:`run_or_defer`) the one ``store``, so that a chunk's W actions run
    the weight grads its B actions queued."""
    for m in module.modules():
        if hasattr(m, "weight_grad_store"):
            m.weight_grad_store = store


class WeightGradStore:
    """A queue of deferred weight-grad computations (the W actions of zero-bubble schedules).

    While ``deferring`` is True, layers call :meth:`put` instead of computing weight grads in
    backward. One :meth:`flush` computes everything queued since the matching :meth:`mark`
    (one microbatch's W). The queue must be empty at the optimizer step (:meth:`assert_empty`).
    """

    def __init__(self) -> None:
        self.deferring = False
        self._queue: deque[list[Callable[[], None]]] = deque()
        self._current: list[Callable[[], None]] | None = None

    def put(self, fn: Callable[[], None]) -> None:
        if self._current is None:
            self._current = []
        self._current.append(fn)

    def mark(self) -> None:
        """Close the group of closures put since the last mark (one B action)."""
        self._queue.append(self._current or [])
        self._current = None

    def flush(self) -> None:
        """Run the oldest group of deferred weight grads (one W action), without autograd
        recording (weight grads are leaves of the step, never differentiated again)."""
        with torch.no_grad():
            for fn in self._queue.popleft():
                fn()

    def __len__(self) -> int:
        return len(self._queue) + (1 if self._current else 0)

    def assert_empty(self) -> None:
        if len(self):
            raise RuntimeError(f"{len(self)} deferred weight-grad groups are still queued at the "
                               "optimizer step; the schedule is missing W actions")


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    main = meta_of(param).main_grad
    return main if main is not None else param.grad


def allreduce_embedding_grads(params, ctx: ParallelContext) -> None:
    """Sum the grads of tied-embedding copies (``shared_embedding=True``) over ``ctx.embedding``.

    With pipeline parallelism the first stage owns the input embedding and the last stage a copy
    used by the output layer; summing their grads keeps both copies equal after every step
    (Narayanan et al. 2021 keep tied embeddings in sync the same way). No-op for non-members
    (middle stages) and when both copies are one tensor (a single stage).
    """
    group = ctx.embedding
    if not group.is_member or group.size == 1:
        return
    for p in params:
        if meta_of(p).shared_embedding:
            g = _grad_of(p)
            if g is None:
                g = torch.zeros_like(p)
                p.grad = g
            group.all_reduce(g)


def allreduce_sequence_parallel_grads(params, ctx: ParallelContext) -> None:
    """Sum over ``ctx.tp`` the grads of replicated params fed sequence-sharded activations.

    Under sequence parallelism each TP rank sees ``s/tp`` positions, so the grads of norm weights
    and row-parallel biases (``sequence_parallel=True``) are partial sums; one all-reduce per
    dtype over a flat buffer completes them and keeps the replicas bitwise equal (Korthikanti et
    al. 2022, section 4.2.2). Uses ``main_grad`` when DDP attached one, else ``.grad``; params
    without a grad are skipped. No-op when TP is 1.
    """
    group = ctx.tp
    if group.size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if meta_of(p).sequence_parallel:
            g = _grad_of(p)
            if g is not None:
                by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        group.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
