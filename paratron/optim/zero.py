"""ZeRO stages 1-3 as one set of sharded buffers over DDP's buckets (Rajbhandari et al. 2020,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sections 5.1-5.3).

Every stage shards by the same rule: rank ``r`` of a buffer's DP group owns slice ``r`` of every
bucket (:meth:`~paratron.optim.grad_buffer.Bucket.shard_range`). :class:`ShardedGrads` holds,
per bucket, this rank's fp32 ``[bucket.numel / N_d]`` shard of the DP-summed grads, which the
optimizer updates from. What differs between stages is only where the full-size tensors live:

* stage 1 (P_os): DDP keeps the full ``grad_data`` buffer and reduce-scatters a bucket into its
  shard once per step (:class:`~paratron.optim.reducers.ReduceScatterBuckets`);
* stage 2 (P_os+g): there is no full grad buffer. The first grad of a bucket allocates a
  bucket-sized staging tensor and attaches ``meta.main_grad`` views into it; once every param of the
  bucket has had a grad since the last flush, the staging tensor is reduce-scattered (async) and
  the result added into the shard, then the staging tensor is dropped. With gradient
  accumulation that is once per microbatch (the price of not keeping full grads, as in
  DeepSpeed's stage 2);
* stage 3 (P_os+g+p): as stage 2, plus the params themselves are sharded
  (:mod:`paratron.optim.param_gather`).

The flush rule depends only on the sequence of grad events, which is the same on every rank of
a DP group (same schedule, same model), so every rank issues the same reduce-scatters in the
same order; expert buckets too, since every local expert has a grad event in every backward pass
(a zero grad when it got no tokens). Deferred buckets (tied-embedding and sequence-parallel params,
whose grads need a model-parallel all-reduce first) wait for :meth:`ShardedGrads.finish` instead
and keep their staging tensor for the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _InFlight:
    handle: object
    out: torch.Tensor     # [bucket.numel / N_d] receives the reduce-scatter
    target: torch.Tensor  # the shard grads it is added into
    staging: torch.Tensor  # kept alive until the collective completes


class ShardedGrads:
    """This rank's fp32 shard of the summed grads of every bucket, and (stage >= 2) the
    transient per-bucket staging of full-size grads.

    Args:
        buffers: DDP's :class:`~paratron.optim.grad_buffer.GradBuffer` list.
        stage: the ZeRO stage, 1 to 3.
        grad_dtype: dtype of the main grads (fp32).

    Attributes:
        shard_grads: ``shard_grads[i][k]`` is ``[buckets[k].numel / N_d]`` (buffer ``i``).
    """

    def __init__(self, buffers, stage: int, grad_dtype: torch.dtype) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"parallel.zero={stage}: ShardedGrads is for ZeRO stages 1-3")
        self.buffers, self.stage, self.grad_dtype = buffers, stage, grad_dtype
        self.shard_grads = [[torch.zeros(b.numel // buf.group.size, dtype=grad_dtype, device=buf.device)
                             for b in buf.buckets] for buf in buffers]
        self._where = {id(p): (i, b.index) for i, buf in enumerate(buffers)
                       for b in buf.buckets for p in b.params}
        self._staging: list[list[torch.Tensor | None]] = [[None] * len(buf.buckets) for buf in buffers]
        self._seen: list[list[set[int]]] = [[set() for _ in buf.buckets] for buf in buffers]
        self._inflight: list[_InFlight] = []
        self.sync_enabled = True
        self.flushes = 0

    # ---- stage >= 2: staging and flushing --------------------------------------------------
    def acquire(self, p: torch.Tensor) -> torch.Tensor:
        """The ``meta.main_grad`` of ``p``: a view into its bucket's staging tensor (allocated, zeroed,
        on the first grad of the bucket since its last flush)."""
        i, k = self._where[id(p)]
        if self._staging[i][k] is None:
            self._stage(i, k)
        return p.meta.main_grad

    def _stage(self, i: int, k: int) -> None:
        buf = self.buffers[i]
        b = buf.buckets[k]
        flat = torch.zeros(b.numel, dtype=self.grad_dtype, device=buf.device)
        self._staging[i][k] = flat
        for p in b.params:
            s, e = buf.index[id(p)]
            p.meta.main_grad = flat[s - b.start:e - b.start].view(buf.shapes[id(p)])

    def grad_event(self, p: torch.Tensor) -> None:
        """``p``'s ``meta.main_grad`` just received a grad: flush its bucket once every param of the
        bucket has one (not for deferred buckets, nor while sync is held)."""
        i, k = self._where[id(p)]
        seen = self._seen[i][k]
        seen.add(id(p))
        b = self.buffers[i].buckets[k]
        if self.sync_enabled and not b.deferred and len(seen) == len(b.params):
            self._flush(i, k)

    def _flush(self, i: int, k: int) -> None:
        buf = self.buffers[i]
        b = buf.buckets[k]
        flat = self._staging[i][k]
        if flat is None:  # every rank flushes these buckets at finish, grads or not
            flat = torch.zeros(b.numel, dtype=self.grad_dtype, device=buf.device)
        out = torch.empty_like(self.shard_grads[i][k])
        handle = buf.group.reduce_scatter_into(out, flat, async_op=True)
        self._inflight.append(_InFlight(handle, out, self.shard_grads[i][k], flat))
        self._staging[i][k] = None
        self._seen[i][k].clear()
        for p in b.params:
            p.meta.main_grad = None
        self.flushes += 1

    def _drain(self) -> None:
        for f in self._inflight:
            if f.handle is not None:
                f.handle.wait()
            f.target.add_(f.out)
        self._inflight.clear()

    def finish(self) -> None:
        """Flush, in bucket order, every bucket holding grads (deferred buckets always), then
        wait: afterwards :attr:`shard_grads` hold the step's DP-summed grads."""
        for i, buf in enumerate(self.buffers):
            for b in buf.buckets:
                if self._staging[i][b.index] is not None or b.deferred:
                    self._flush(i, b.index)
        self._drain()

    def start_step(self) -> None:
        """Zero the shard grads and drop staged grads; deferred buckets get their staging now
        (the model-parallel all-reduces of :mod:`paratron.optim.finalize` read ``main_grad``)."""
        self._drain()
        self.flushes = 0
        for shards in self.shard_grads:
            for t in shards:
                t.zero_()
        if self.stage < 2:
            return
        for i, buf in enumerate(self.buffers):
            for b in buf.buckets:
                self._seen[i][b.index].clear()
                self._staging[i][b.index] = None
                for p in b.params:
                    p.meta.main_grad = None
                if b.deferred:
                    self._stage(i, b.index)

    # ---- accounting -------------------------------------------------------------------------
    def grad_tensors(self) -> list[torch.Tensor]:
        """The grad storage alive now: shards, staging and in-flight buffers."""
        out = [t for shards in self.shard_grads for t in shards]
        out += [t for row in self._staging for t in row if t is not None]
        out += [t for f in self._inflight for t in (f.out, f.staging)]
        return out


ZERO_LEVELS = (0, 1, 2, 3)
"""``parallel.zero``: 0 (DDP), 1 (optimizer state sharded), 2 (also grads), 3 (also params)."""


def check_zero_level(zero: int) -> None:
    """The rule of ``parallel.zero``; pure, so the config validator runs it before any process
    group exists, and :func:`~paratron.optim.reducers.reducer_class` (which
    :class:`~paratron.optim.ddp.DistributedDataParallel` calls) and :func:`model_state_bytes_per_rank` run it again.

    Raises:
        ValueError: ``zero`` not in :data:`ZERO_LEVELS`.
    """
    if zero not in ZERO_LEVELS:
        raise ValueError(f"parallel.zero={zero} must be 0 (DDP), 1 (optimizer state sharded), 2 (also "
                         "grads) or 3 (also params)")


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def model_state_bytes_per_rank(num_params: int, *, zero: int, dp: int, param_bytes: int = 4,
                               optimizer: str = "adamw") -> dict[str, float]:
    """Analytic bytes per rank of params, main grads and optimizer state (Rajbhandari et al.
    2020, section 3.1 and figure 1), for ``num_params`` (Ψ) params held by one DP group.

    Main grads are fp32 (4Ψ); AdamW keeps two fp32 moments (8Ψ), SGD with momentum one (4Ψ);
    params of 2 bytes add an fp32 main copy (4Ψ) to the optimizer state. Stage 1 divides the
    optimizer state by ``dp``, stage 2 also the grads, stage 3 also the params. So fp32 AdamW at
    stage 3 is ``16Ψ / dp``. Bucket padding (under ``dp`` elements per bucket) is not counted.

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes.

    Raises:
        ValueError: ``zero`` not in 0..3, ``dp < 1`` or an unknown optimizer.
    """
    check_zero_level(zero)
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    moments = {"adamw": 8, "sgd": 4, "sgd_nomomentum": 0}
    if optimizer not in moments:
        raise ValueError(f"optimizer={optimizer!r} must be one of {sorted(moments)}")
    psi = float(num_params)
    opt = psi * (moments[optimizer] + (4 if param_bytes != 4 else 0))
    out = {"params": psi * param_bytes / (dp if zero >= 3 else 1),
           "grads": psi * 4 / (dp if zero >= 2 else 1),
           "optimizer": opt / (dp if zero >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
