"""What one training step costs on one rank, counted the same way on meta and on real tensors.

:func:`measure_step` runs one whole step of the real code (``run_global_batch`` through the
pipeline runtime, then ``Optimizer.step``) and returns this rank's :class:`StepMeasure`:

* model-state bytes by kind, from the storages DDP / ZeRO and the optimizer allocated
  (``ddp.model_state_tensors()``, ``optimizer.allocated_state()``), each distinct storage once;
* the peak bytes of saved activations over the step (:class:`SavedBytes`, a
  ``torch.autograd.graph.saved_tensors_hooks`` pair): each tensor autograd saves for backward is
  counted while the graph holds it, a storage saved twice counts once, parameters (and views
  of their storage, e.g. a transposed or tied weight) are not activations; with the (microbatch, stage) whose action was running when the peak was set;
* under zero-bubble schedules, the tensors each deferred weight-grad closure holds (its ``x`` and
  ``dy``, kept outside autograd's saved tensors from the ``B`` to the ``W``), counted with the
  saved activations (:func:`_meter_store`);
* the comm ledger (bytes and calls per op and group) and the shape of every p2p message.

Both a dry run (:mod:`paratron.dryrun.rehearse`) and a real CPU run call this function, so their
figures compare like for like (``tests/test_dryrun.py``).
"""

from __future__ import annotations

import types
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import nn

from paratron.pipeline.timeline import TraceEvent
from paratron.training.step import run_global_batch


def storage_key(t: torch.Tensor) -> int:
    """An identity of the storage behind ``t`` that also tells meta storages apart (their data
    pointers are all 0): the address of torch's storage object."""
    return t.untyped_storage()._cdata


def distinct_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(storage_key(t), t.untyped_storage().nbytes())
    return sum(seen.values())


class _Held:
    """One saved tensor, counted while autograd keeps this handle (released with the graph)."""

    __slots__ = ("t", "key", "meter")

    def __init__(self, t: torch.Tensor, key: int, meter: "SavedBytes") -> None:
        self.t, self.key, self.meter = t, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


class SavedBytes:
    """Live and peak bytes of the tensors autograd saves for backward (a saved-tensor hook count).

    ``scope()`` names the action running now (``(microbatch, stage)`` or None); the peak keeps
    the scope that set it and the microbatches whose activations were alive then.
    """

    def __init__(self, scope, param_tensors=()) -> None:
        self.scope = scope
        self.params = list(param_tensors)  # views of their storage now are not activations
        self.live = 0
        self.peak = 0
        self.peak_scope = None
        self.peak_holders: list = []
        self._refs: dict[int, list] = {}  # storage key -> [count, bytes, scope]

    def pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return t
        key = storage_key(t)
        if key in self._param_keys():
            return t
        ref = self._refs.get(key)
        if ref is None:
            ref = self._refs[key] = [0, t.untyped_storage().nbytes(), self.scope()]
            self.live += ref[1]
            if self.live > self.peak:
                self.peak, self.peak_scope = self.live, ref[2]
                self.peak_holders = sorted({tuple(r[2]) for r in self._refs.values() if r[2] is not None})
        ref[0] += 1
        return _Held(t, key, self)

    def _param_keys(self) -> set[int]:
        """The storages the params use *now*. Read at each pack, not once: ZeRO-3 points a
        param's ``.data`` at a new storage on every gather and free, and the address of a freed
        storage is reused by later tensors, so a key kept from before would hide activations
        (a different set on each run, as the allocator reuses different addresses)."""
        return {storage_key(t) for t in self.params}

    @staticmethod
    def unpack(held):
        return held.t if isinstance(held, _Held) else held

    def release(self, key: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self._refs[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


@dataclass
class StepMeasure:
    """One rank's figures for one step (bytes unless named otherwise)."""

    params: int
    grads: int
    main_params: int
    optimizer_state: int
    peak_activations: int
    peak_at: tuple | None  # (microbatch, stage) of the action that set the peak
    in_flight_at_peak: list = field(default_factory=list)  # (microbatch, stage) alive then
    ledger: dict = field(default_factory=dict)  # "op@group" -> {"calls", "bytes"}
    p2p: list = field(default_factory=list)  # [op, peer, shape, dtype] per message, in order

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def model_state(ddp, optimizer) -> dict[str, int]:
    """Bytes this rank holds of params, grads (DDP / ZeRO buffers), main params and optimizer
    state (the optimizer's own allocations), each distinct storage once."""
    held = ddp.model_state_tensors()
    alloc = optimizer.allocated_state()
    return {"params": distinct_bytes(held["params"]), "grads": distinct_bytes(held["grads"]),
            "main_params": distinct_bytes(alloc.get("main_param", [])),
            "optimizer_state": distinct_bytes(t for k, ts in alloc.items() if k != "main_param" for t in ts)}


def _recording_p2p(group, messages: list):
    """Wrap ``group.p2p_op`` on this instance so that each message's shape is noted."""
    inner = group.p2p_op

    def p2p_op(kind, t, peer):
        messages.append([kind, group.ranks[peer], list(t.shape), str(t.dtype).replace("torch.", "")])
        return inner(kind, t, peer)

    group.p2p_op = p2p_op
    return inner


def closure_tensors(fn, depth: int = 3) -> list[torch.Tensor]:
    """The tensors a closure holds through its cells (and those of the functions it holds, to
    ``depth``): what a deferred weight-grad computation keeps alive from its ``B`` to its ``W``."""
    out: list[torch.Tensor] = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, types.FunctionType) and depth:
            out += closure_tensors(v, depth - 1)
    return out


def _meter_store(store, meter: "SavedBytes") -> None:
    """Count, on this store instance, the tensors its queued weight-grad closures hold (the
    ``dy`` and ``x`` of each deferred ``W``, alive outside autograd's saved tensors from the
    ``B`` to the ``W``) as saved bytes, from :meth:`put` until the group's :meth:`flush`."""
    put, mark, flush = store.put, store.mark, store.flush
    current: list = []
    queued: deque = deque()

    def metered_put(fn) -> None:
        current.extend(meter.pack(t) for t in closure_tensors(fn))
        put(fn)

    def metered_mark() -> None:
        queued.append(list(current))
        current.clear()
        mark()

    def metered_flush() -> None:
        flush()
        queued.popleft()  # the group's handles go: their bytes are released

    store.put, store.mark, store.flush = metered_put, metered_mark, metered_flush


def _metering_stores(chunks, meter: "SavedBytes") -> None:
    """Wrap each chunk's ``use_weight_grad_store`` on the instance, so that the store the
    pipeline runtime gives it is metered (:func:`_meter_store`)."""
    for chunk in chunks:
        inner = chunk.use_weight_grad_store

        def use(store, inner=inner) -> None:
            _meter_store(store, meter)
            inner(store)

        chunk.use_weight_grad_store = use


def measure_step(cfg, ctx, chunks, ddp, optimizer, microbatches: list[dict], actions=None) -> StepMeasure:
    """Run one training step (forward/backward of ``microbatches`` through the pipeline schedule,
    then the optimizer) and return this rank's :class:`StepMeasure`."""
    state = model_state(ddp, optimizer)
    timeline: list[TraceEvent] = []  # makes the runtime stamp each action's scope on the ledger
    params = [p for c in chunks for p in c.parameters()] + ddp.model_state_tensors()["params"]
    meter = SavedBytes(lambda: getattr(ctx.ledger.intervals, "scope", None), params)
    messages: list = []
    inner = _recording_p2p(ctx.pp, messages)
    _metering_stores(chunks, meter)
    try:
        with ctx.ledger.recording(), meter.hooks():
            optimizer.zero_grad()
            run_global_batch(cfg, ctx, chunks, microbatches, forward_only=False,
                             loss_scale=optimizer.loss_scale, actions=actions, ddp=ddp, timeline=timeline)
            optimizer.step()
            ledger = ctx.ledger.summary()
    finally:
        ctx.pp.p2p_op = inner
        for chunk in chunks:
            chunk.__dict__.pop("use_weight_grad_store", None)
    return StepMeasure(**state, peak_activations=meter.peak, peak_at=meter.peak_scope,
                       in_flight_at_peak=[list(h) for h in meter.peak_holders], ledger=ledger, p2p=messages)
