"""ZeRO-3 parameter sharding: gather a unit's params just before use, free them after
(Rajbhandari et al. 2020, section 5.3, P_p; the unit-wise gather with prefetch follows the same
paper's section 7.2.2 and PyTorch FSDP, Zhao et al. 2023, section 3.3).

A *unit* is a module whose forward needs a set of params: for a GPT chunk, the embedding, each
transformer layer, and the head (final norm plus output weight, gathered from the final norm's
forward until the end of the chunk's forward; with multi-token prediction also the MTP modules
and the word embedding they share, which run in that window). In any other model each module of a direct
``ModuleList``/``ModuleDict`` child is a unit and the remaining params form one unit that spans
the chunk's whole forward. DDP lays out the
buckets so that a bucket never spans two units (:mod:`paratron.optim.grad_buffer`), and
:class:`ParamShards` keeps, per bucket, only this rank's ``[bucket.numel / N_d]`` shard of the
params (in the params' dtype: bf16 gathers bf16 while the optimizer's fp32 main weights stay
sharded). Between uses a param's ``.data`` is an empty tensor.

Hooks on each unit:

* forward pre-hook: gather the unit (waiting for its prefetch), then start the all-gather of the
  next unit of the chunk (so it overlaps this unit's compute); hook the unit's input, whose grad
  completes when the unit's backward is done, to free the unit again;
* forward post-hook: hook the unit's output, whose grad arrives just before the unit's backward,
  to free the later units (their backward is complete), gather the unit again and prefetch the
  previous one, so at most two units are gathered at any time; free the unit when
  ``reshard_after_forward``, except the two units whose backward runs first (the head, or the
  spanning unit, and the last layer): their backward follows at once, so they stay gathered (as
  FSDP leaves its root unsharded and torchtitan its last block) unless another forward of the
  chunk starts first. At most two units are still gathered at once in a GPT chunk: the last layer
  and the head, while the head runs forward and backward. With ``reshard_after_forward``
  false, gathered units stay until :meth:`ParamShards.release_all` at the end of the step's
  backward: one all-gather per unit and step, kept across the microbatches of a pipeline
  schedule.

Weight grads of paratron's linears need only activations (``dW = dy^T x``), so the deferred W
actions of zero-bubble schedules run with the unit freed. A forward run again inside backward
(activation recompute) keeps its params: the backward that follows needs them (freeing them
would only cost another all-gather at the unit's pre-backward hook).
All-gathers are issued in the same order on every rank of a DP group (same schedule, same model).

FP8 param gather (``train.fp8_param_gather``, :meth:`ParamShards.enable_fp8_gather`): the weights
of the FP8 linears travel as e4m3, one byte an element instead of two (bf16), with one scale per
weight from its amax MAX-reduced over DP and TP (the whole logical weight, so the cast values are
those of FP8 at one process); the linear casts the dequantised weight again and gets the same FP8
values. Other params of the bucket (norms, biases, padding) travel in their dtype in a second
all-gather. :meth:`ParamShards.gathered` (checkpoints, evaluation helpers) always gathers exactly.
Tensorwise FP8 only (the validator refuses rowwise: its per-row scales are not the one scale of the
gather, so the weight would be rounded twice).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratron.parallel.params import unique_params


@dataclass
class Unit:
    """Params gathered together: ``start``'s forward gathers them, ``end``'s forward ends their
    use; ``buckets`` are ``(buffer, bucket)`` index pairs (filled by :class:`ParamShards`)."""

    start: nn.Module
    end: nn.Module
    params: list[nn.Parameter]
    buckets: list[tuple[int, int]] = field(default_factory=list)
    held: bool = False
    chunk: int = 0
    pos: int = 0
    backward_next: "Unit | None" = None
    keep_after_forward: bool = False  # one of the chunk's first two backwards: kept after forward
    end_order: int = 0  # where its forward ends among the chunk's units (its backward starts in reverse)
    kept: bool = False            # held since its forward, waiting for its backward


def _generic_units(chunk: nn.Module) -> list[Unit]:
    """Each module of the chunk's direct ModuleList/ModuleDict children is a unit; the chunk's
    other params form one unit gathered for the chunk's whole forward (as FSDP wraps blocks and
    leaves the rest to the root)."""
    blocks = []
    for child in chunk.children():
        if isinstance(child, nn.ModuleList):
            blocks += list(child)
        elif isinstance(child, nn.ModuleDict):
            blocks += list(child.values())
    units = [Unit(b, b, unique_params(b, trainable_only=True)) for b in blocks]
    covered = {id(p) for u in units for p in u.params}
    rest = [p for p in unique_params(chunk, trainable_only=True) if id(p) not in covered]
    units = [u for u in units if u.params]
    return ([Unit(chunk, chunk, rest)] if rest else []) + units


def units_of(chunk: nn.Module) -> list[Unit]:
    """The units of one model chunk in forward order (see module docstring)."""
    layers = getattr(chunk, "layers", None)
    if not (isinstance(layers, nn.ModuleDict) and hasattr(chunk, "output_weight")):
        return _generic_units(chunk)
    units = []
    emb = getattr(chunk, "embedding", None)
    if emb is not None:
        units.append(Unit(emb, emb, unique_params(emb, trainable_only=True)))
    for layer in layers.values():
        units.append(Unit(layer, layer, unique_params(layer, trainable_only=True)))
    norm = getattr(chunk, "final_norm", None)
    if norm is not None:
        head = unique_params(norm, trainable_only=True) + [chunk.output_weight()] + _mtp_params(chunk)
        units.append(Unit(norm, chunk, list({id(p): p for p in head if p.requires_grad}.values())))
    covered = {id(p) for u in units for p in u.params}
    rest = [p for p in unique_params(chunk, trainable_only=True) if id(p) not in covered]
    if rest:
        raise ValueError(f"ZeRO-3: params {[p.meta.logical_name for p in rest]} belong to no unit of the chunk")
    # Frozen params (a LoRA base) are never sharded: a unit of only frozen params gathers nothing.
    return [u for u in units if u.params]


def _mtp_params(chunk: nn.Module) -> list[nn.Parameter]:
    """The params the chunk's multi-token-prediction modules use (:mod:`paratron.models.mtp`):
    their own and the word embedding they look the shifted tokens up in (this chunk's, another
    chunk's on the same rank, or the last stage's copy). They run inside the chunk's forward after
    the head and call the embedding's inner lookup directly (no unit hook fires), so they join
    the head unit, which is gathered from the final norm to the end of the chunk's forward and,
    in backward, from the chunk's output grad until the last layer's backward starts."""
    mtp = getattr(chunk, "mtp", None)
    if mtp is None:
        return []
    return unique_params(mtp, trainable_only=True) + [mtp.word_embedding.weight]


def unit_ids(chunks, params) -> dict[int, int]:
    """``id(param) -> unit number`` (over all chunks): the first unit, in forward order, that
    needs the param (a tied weight belongs to the embedding's unit)."""
    out: dict[int, int] = {}
    n = 0
    for chunk in chunks:
        for u in units_of(chunk):
            for p in u.params:
                out.setdefault(id(p), n)
            n += 1
    return out


def _grad_tensors(obj):
    """The tensors in ``obj`` (nested tuples/lists) that require grad, in order."""
    if torch.is_tensor(obj):
        if obj.requires_grad:
            yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _grad_tensors(o)


def _first_grad_tensor(obj):
    return next(_grad_tensors(obj), None)


def _in_backward() -> bool:
    """Whether autograd is executing a backward now (a forward run inside it is a recompute).
    PyTorch has no public query for this; the engine's current graph task id is -1 outside."""
    return torch._C._current_graph_task_id() != -1


_E4M3 = torch.float8_e4m3fn


class _Fp8Bucket:
    """How one bucket's FP8 gather splits its elements: ``slot[j]`` is the index (in ``params``)
    of the FP8 weight that bucket element ``j`` belongs to, -1 for the rest."""

    def __init__(self, buf, bucket, params) -> None:
        self.params = params
        self.slot = torch.full((bucket.numel,), -1, dtype=torch.long)
        for j, p in enumerate(params):
            s, e = buf.index[id(p)]
            self.slot[s - bucket.start:e - bucket.start] = j
        n = buf.group.size
        self.size = bucket.numel // n
        self.masks = [self.slot[r * self.size:(r + 1) * self.size] >= 0 for r in range(n)]
        self.max_fp8 = max(int(m.sum()) for m in self.masks)
        self.max_rest = max(self.size - int(m.sum()) for m in self.masks)


class _Fp8Gather:
    """The two all-gathers of one bucket in flight; :meth:`wait` decodes them into ``full``."""

    def __init__(self, plan: _Fp8Bucket, full, fp8, rest, inv, handles) -> None:
        self.plan, self.full, self.fp8, self.rest, self.inv, self.handles = plan, full, fp8, rest, inv, handles

    def wait(self) -> None:
        for h in self.handles:
            if h is not None:
                h.wait()
        plan = self.plan
        n = len(plan.masks)
        fp8, rest = self.fp8.view(n, plan.max_fp8), self.rest.view(n, plan.max_rest)
        for r, mask in enumerate(plan.masks):
            seg = self.full[r * plan.size:(r + 1) * plan.size]
            nf = int(mask.sum())
            slots = plan.slot[r * plan.size:(r + 1) * plan.size][mask]
            seg[mask] = (fp8[r, :nf].view(_E4M3).float() * self.inv[slots]).to(seg.dtype)
            seg[~mask] = rest[r, :plan.size - nf]


class ParamShards:
    """Sharded param storage of every bucket, the gathered copies, and the unit hooks.

    Args:
        buffers: DDP's buffers (built with unit boundaries); their ``param_data`` is released.
        chunks: the model chunks.
        reshard_after_forward: free a unit after its forward (``parallel.zero3_reshard_after_forward``).
        prefetch: start the next unit's all-gather early.

    Attributes:
        shards: ``shards[i][k]`` is ``[buckets[k].numel / N_d]`` in the params' dtype.
        gathered_bytes, peak_gathered_bytes: bytes of full params alive now / at most since
            :meth:`reset_peak` (for the memory tests).
    """

    def __init__(self, buffers, chunks, *, reshard_after_forward: bool = True, prefetch: bool = True) -> None:
        self.buffers, self.reshard, self.prefetch = buffers, bool(reshard_after_forward), bool(prefetch)
        self.shards = []
        for buf in buffers:
            g = buf.group
            self.shards.append([buf.param_data[slice(*b.shard_range(max(g.rank, 0), g.size))].clone()
                                for b in buf.buckets])
        where = {id(p): (i, b.index) for i, buf in enumerate(buffers) for b in buf.buckets for p in b.params}
        self._full: list[list[torch.Tensor | None]] = [[None] * len(buf.buckets) for buf in buffers]
        self._pending: list[list[object]] = [[None] * len(buf.buckets) for buf in buffers]
        self._viewed = [[False] * len(buf.buckets) for buf in buffers]  # params point into _full
        self._layouts: dict[tuple[int, int], tuple] = {}  # see _layout
        self._holders: list[list[set[int]]] = [[set() for _ in buf.buckets] for buf in buffers]
        self.chunk_units = [self._attach(c, chunk, where) for c, chunk in enumerate(chunks)]
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self._fp8: dict[tuple[int, int], _Fp8Bucket] = {}  # FP8 param gather plans (enable_fp8_gather)
        self._fp8_group = None
        self._exact = False  # inside gathered(): no FP8
        for buf in buffers:
            for p in buf.params:
                p.data = torch.empty(0, dtype=buf.dtype, device=buf.device)
            buf.param_data = None  # the full flat copy is gone: only shards remain

    def _attach(self, c: int, chunk: nn.Module, where) -> list[Unit]:
        """Find chunk ``c``'s units, their buckets and backward order, and hook them."""
        units = units_of(chunk)
        # Backward runs in the reverse order of the forwards' *ends*: a unit spanning the
        # chunk's forward (the generic rest) ends last, so its backward starts first.
        by_end = sorted(units, key=lambda u: (u.end is chunk, units.index(u)))
        for pos, u in enumerate(units):
            u.chunk, u.pos = c, pos
            j = by_end.index(u)
            u.backward_next = by_end[j - 1] if j > 0 else None
            u.keep_after_forward, u.end_order = j >= len(by_end) - 2, j
            u.buckets = sorted({where[id(p)] for p in u.params})
            u.start.register_forward_pre_hook(self._pre_forward_hook(u))
            u.end.register_forward_hook(self._post_forward_hook(u))
        return units

    def enable_fp8_gather(self, params, tp_group) -> None:
        """All-gather ``params`` (the FP8 linears' weights, 2-D) as e4m3 from now on, with
        scales reduced over each bucket's DP group and ``tp_group`` (see the module docstring)."""
        ids = {id(p) for p in params}
        self._fp8_group = tp_group
        for i, buf in enumerate(self.buffers):
            for b in buf.buckets:
                mine = [p for p in b.params if id(p) in ids]
                if mine:
                    self._fp8[(i, b.index)] = _Fp8Bucket(buf, b, mine)

    def _launch_fp8(self, i: int, k: int, full: torch.Tensor):
        """Cast this rank's shard of FP8 weights to e4m3 and start both all-gathers."""
        buf, plan = self.buffers[i], self._fp8[(i, k)]
        r = max(buf.group.rank, 0)
        shard, mask = self.shards[i][k], plan.masks[r]
        slots = plan.slot[r * plan.size:(r + 1) * plan.size][mask]
        vals = shard[mask].float()
        amax = torch.zeros(len(plan.params), device=shard.device).scatter_reduce_(0, slots, vals.abs(), "amax")
        for g in (buf.group, self._fp8_group):  # the whole logical weight's amax
            g.all_reduce(amax, op=dist.ReduceOp.MAX)
        fmax = torch.finfo(_E4M3).max
        scale = fmax / amax.clamp(min=1e-12)
        send_f = torch.zeros(plan.max_fp8, dtype=torch.uint8, device=shard.device)
        send_f[:vals.numel()] = (vals * scale[slots]).clamp(-fmax, fmax).to(_E4M3).view(torch.uint8)
        send_r = torch.zeros(plan.max_rest, dtype=shard.dtype, device=shard.device)
        rest = shard[~mask]
        send_r[:rest.numel()] = rest
        n = buf.group.size
        recv_f = torch.empty(n * plan.max_fp8, dtype=torch.uint8, device=shard.device)
        recv_r = torch.empty(n * plan.max_rest, dtype=shard.dtype, device=shard.device)
        handles = [buf.group.all_gather_into(recv, send, async_op=True)
                   for recv, send in ((recv_f, send_f), (recv_r, send_r)) if send.numel()]
        return _Fp8Gather(plan, full, recv_f, recv_r, scale.reciprocal(), handles)

    # ---- buckets ----------------------------------------------------------------------------
    def _launch(self, i: int, k: int) -> None:
        if self._full[i][k] is not None:
            return
        buf = self.buffers[i]
        b = buf.buckets[k]
        full = torch.empty(b.numel, dtype=buf.dtype, device=buf.device)
        self._full[i][k] = full
        if (i, k) in self._fp8 and not self._exact:
            self._pending[i][k] = self._launch_fp8(i, k, full)
        else:
            self._pending[i][k] = buf.group.all_gather_into(full, self.shards[i][k], async_op=True)
        self.gathered_bytes += full.numel() * full.element_size()
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _materialize(self, i: int, k: int) -> None:
        self._launch(i, k)
        if self._viewed[i][k]:
            return
        handle, self._pending[i][k] = self._pending[i][k], None
        if handle is not None:  # None: a group of one copied at once
            handle.wait()
        self._viewed[i][k] = True
        sizes, placed = self._layout(i, k)
        pieces = self._full[i][k].split(sizes)
        for j, p, shape in placed:
            p.data = pieces[j].view(shape)

    def _layout(self, i: int, k: int):
        """Bucket ``(i, k)`` cut into pieces: ``sizes`` (every param and every gap of padding, in
        flat order) and ``placed``, ``(piece index, param, shape)`` per param. Computed once, so
        a gather views its params with one ``split``."""
        if (i, k) not in self._layouts:
            buf = self.buffers[i]
            b = buf.buckets[k]
            sizes, placed, pos = [], [], b.start
            for s, e, p in sorted(((*buf.index[id(p)], p) for p in b.params), key=lambda t: t[0]):
                if s > pos:
                    sizes.append(s - pos)
                placed.append((len(sizes), p, buf.shapes[id(p)]))
                sizes.append(e - s)
                pos = e
            if b.end > pos:
                sizes.append(b.end - pos)
            self._layouts[(i, k)] = (sizes, placed)
        return self._layouts[(i, k)]

    def _free(self, i: int, k: int) -> None:
        full = self._full[i][k]
        if full is None:
            return
        if self._pending[i][k] is not None:
            self._pending[i][k].wait()
            self._pending[i][k] = None
        buf = self.buffers[i]
        for p in buf.buckets[k].params:
            p.data = torch.empty(0, dtype=buf.dtype, device=buf.device)
        self._full[i][k] = None
        self._viewed[i][k] = False
        self.gathered_bytes -= full.numel() * full.element_size()

    # ---- units ------------------------------------------------------------------------------
    def hold(self, u: Unit) -> None:
        """Gather ``u`` (wait for it) and keep it until :meth:`release`."""
        for i, k in u.buckets:
            self._holders[i][k].add(id(u))
            self._materialize(i, k)
        u.held = True

    def release(self, u: Unit) -> None:
        """Free ``u``'s buckets that no other held unit needs."""
        if not u.held:
            return
        u.held = False
        for i, k in u.buckets:
            self._holders[i][k].discard(id(u))
            if not self._holders[i][k]:
                self._free(i, k)

    def release_all(self) -> None:
        """Free every gathered unit (end of the step's backward; before the optimizer step)."""
        for units in self.chunk_units:
            for u in units:
                u.kept = False
                self.release(u)
        for i, row in enumerate(self._full):
            for k in range(len(row)):
                self._free(i, k)  # prefetched but never used

    def _prefetch(self, chunk: int, pos: int) -> None:
        units = self.chunk_units[chunk]
        if self.prefetch and 0 <= pos < len(units):
            for i, k in units[pos].buckets:
                self._launch(i, k)

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self.gathered_bytes

    # ---- hooks ------------------------------------------------------------------------------
    def _pre_forward_hook(self, u: Unit):
        def hook(module, args):
            if u.pos == 0 and not _in_backward():
                self._drop_kept(u.chunk)  # a second forward before the kept unit's backward
            self.hold(u)
            if not _in_backward():
                self._prefetch(u.chunk, u.pos + 1)
            x = _first_grad_tensor(args)
            if x is not None and torch.is_grad_enabled() and self.reshard:
                x.register_hook(lambda g: self.release(u))
        return hook

    def _post_forward_hook(self, u: Unit):
        def hook(module, args, out):
            # Every output: a chunk with MTP returns (losses, MTP losses), and autograd may run
            # the MTP branch's backward first; the first grad to arrive gathers the unit.
            if torch.is_grad_enabled():
                fired = []

                def first(g):
                    if not fired:
                        fired.append(True)
                        self._pre_backward(u)
                for y in _grad_tensors(out):
                    y.register_hook(first)
            if self.reshard and not _in_backward():
                if u.keep_after_forward and torch.is_grad_enabled():
                    u.kept = True  # its backward comes next: gathering it again would be waste
                else:
                    self.release(u)
        return hook

    def _drop_kept(self, chunk: int) -> None:
        """Free a unit kept gathered since its forward (a new forward of the chunk starts first:
        pipeline warm-up, evaluation); its backward will gather it again."""
        for u in self.chunk_units[chunk]:
            if u.kept:
                u.kept = False
                self.release(u)

    def _pre_backward(self, u: Unit) -> None:
        u.kept = False
        if self.reshard:
            # The grad of u's output is complete, so the backward of every unit whose forward
            # ran wholly after u's is done: free them before gathering the next (their input
            # hooks run after this). A unit spanning u (started before, ended after) is not.
            for later in self.chunk_units[u.chunk][u.pos + 1:]:
                if later.end_order > u.end_order:
                    self.release(later)
        self.hold(u)
        if self.prefetch and u.backward_next is not None:
            for i, k in u.backward_next.buckets:
                self._launch(i, k)

    @contextmanager
    def gathered(self, writeback: bool = False):
        """Every param gathered inside the block (checkpoints, evaluation helpers); with
        ``writeback`` the (possibly changed) full params are copied back into the shards. FP8
        param gather is off inside the block: every bucket is gathered exactly.

        Raises:
            RuntimeError: a unit gathered in FP8 is held (inside a step's forward/backward)."""
        for i, k in self._fp8:
            if self._holders[i][k]:
                raise RuntimeError("ParamShards.gathered inside a step: a unit is held gathered in FP8")
            self._free(i, k)
        self._exact = True
        for i, buf in enumerate(self.buffers):
            for b in buf.buckets:
                self._materialize(i, b.index)
        try:
            yield
        finally:
            for i, buf in enumerate(self.buffers):
                g = buf.group
                for b in buf.buckets:
                    if writeback:
                        s, e = b.shard_range(max(g.rank, 0), g.size)
                        self.shards[i][b.index].copy_(self._full[i][b.index][s - b.start:e - b.start])
                    if not self._holders[i][b.index]:
                        self._free(i, b.index)
            self._exact = False

    def param_tensors(self) -> list[torch.Tensor]:
        """Param storage alive now: shards and gathered buckets."""
        return [t for row in self.shards for t in row] + [t for row in self._full for t in row if t is not None]

