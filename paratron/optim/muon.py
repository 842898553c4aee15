"""Muon: momentum orthogonalised by Newton-Schulz, for the hidden weight matrices, over any layout.

Muon (K. Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; J. Liu et
al. 2025, "Muon is Scalable for LLM Training", Moonshot AI) updates a weight matrix ``W [m, n]``
with the orthogonalised momentum of its grads:

    ``M <- beta M + (1 - beta) G``                         (momentum, an EMA as in torch.optim.Muon)
    ``U = (1 - beta) G + beta M`` (Nesterov) or ``U = M``
    ``O = NS5(U)``                                          (~ the polar factor ``U V^T`` of ``U``)
    ``W <- W (1 - lr wd) - lr * scale(m, n) * O``          (decoupled weight decay)

``NS5`` is five steps of the quintic Newton-Schulz iteration ``X <- a X + (b A + c A^2) X`` with
``A = X X^T`` and Jordan's coefficients ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, started from
``U / ||U||_F``. It does not converge to ``U V^T`` exactly: the singular values of the result lie
in roughly ``[0.7, 1.2]`` (Jordan's write-up), which trains as well. ``scale`` is Megatron-Core's
``muon_scale_mode``: ``spectral`` = ``sqrt(max(m, n))`` (Moonshot section 2.2; times
``muon_extra_scale_factor`` = 0.2 by default, which gives the update the RMS of an AdamW update so
AdamW's lr and weight decay carry over), ``unit_rms_norm`` = ``sqrt(m / n)`` and
``shape_scaling`` = ``sqrt(max(1, m / n))`` (Jordan's).

Which params: every 2-D weight (attention, MLP, expert and router projections). The embeddings
(``embedding.*``), the output head (``output_layer.*``) and every 1-D param (norms, biases) are
stepped by AdamW, as both papers prescribe.

**Logical matrices.** A fused weight holds several matrices that act independently, so each is
orthogonalised on its own (with its own scale): SwiGLU's ``fc1 = [gate; up]`` (a strided shard)
always, and the fused QKV (``param.meta.qkv_split``: per KV group ``[q rows; k row block; v row
block]``) as Q, K and V when ``optimizer.muon_split_qkv`` (Megatron's default). Orthogonalising
the fused weight whole would couple matrices that merely share a GEMM.

**Any layout gives the same update.** The orthogonalisation needs the whole logical matrix, which
ZeRO and TP split:

1. the momentum and ``U`` are elementwise, so they are computed on the flat range this rank owns
   (its ZeRO shard of each bucket, or the whole buffer), and the momentum stays sharded like
   Adam's moments (and checkpoints as ``optimizer/momentum/<name>``, resharding like them);
2. with ZeRO (stages 1-3 shard alike), each bucket that holds a Muon matrix all-gathers ``U``
   over its DP group, as the params are all-gathered after a step: every rank then holds the
   TP-local ``U`` of every matrix of the bucket;
3. the whole matrices are split over the DP ranks (greedily by Newton-Schulz cost, as Megatron's
   layer-wise distributed optimizer splits whole matrices); the rank that orthogonalises a
   TP-split matrix all-gathers it over its TP group along ``partition_dim``
   (:func:`paratron.parallel.params.gather_full`, which puts strided blocks back in order), and
   every TP rank of it does the same (Megatron's ``duplicated`` TP mode: no extra collective);
4. each rank writes the rows/columns of its TP slice of its matrices' ``O`` into a zero buffer
   of the bucket (or buffer), and one reduce-scatter (ZeRO) or all-reduce (replicas) over the DP
   group hands every rank ``O`` of the range it owns. Each element is non-zero on one rank only,
   so the sum is exact.

The collectives per step are therefore an all-gather and a reduce-scatter of the Muon buckets
(ZeRO) or one all-reduce (replicas), plus the TP all-gathers of the matrices; the Newton-Schulz
work per rank is divided by the DP size. Every rank runs the same fp32 arithmetic on the same
full matrix, so the update matches a single process to the rounding of the grads' reductions.
"""

from __future__ import annotations

import math

import torch

from ..parallel.params import gather_full

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Jordan's quintic Newton-Schulz coefficients (maximal slope at zero)."""

SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")

ADAMW_PREFIXES = ("embedding.", "output_layer.")
"""Logical-name prefixes of the 2-D params that AdamW steps under ``optimizer.name = "muon"``."""


def uses_muon(p: torch.Tensor) -> bool:
    """Whether Muon steps ``p``: a 2-D weight outside the embeddings and the output head."""
    if len(p.meta.shard.global_shape) != 2 or p.meta.shared_embedding:
        return False
    return not p.meta.logical_name.startswith(ADAMW_PREFIXES)


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients=NS_COEFFICIENTS,
                  eps: float = 1e-7) -> torch.Tensor:
    """The approximate orthogonalisation ``NS5(g)`` of a matrix (module docstring), in fp32.

    Args:
        g: ``[m, n]``, any float dtype.
        steps: iterations (Megatron's ``muon_num_ns_steps``).
        coefficients: ``(a, b, c)`` of ``X <- a X + (b A + c A^2) X``.
        eps: guards the normalisation of a zero matrix (which stays zero).

    Returns:
        ``[m, n]`` fp32 with singular values near 1 (about 0.7-1.2 for the default
        coefficients and 5 steps) and the singular vectors of ``g``.

    Raises:
        ValueError: ``g`` is not 2-D.
    """
    if g.dim() != 2:
        raise ValueError(f"newton_schulz needs a matrix, got shape {tuple(g.shape)}")
    a, b, c = coefficients
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    x = x / (x.norm() + eps)  # Frobenius >= spectral norm: singular values now in [0, 1]
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T.contiguous() if tall else x


def scale_factor(rows: int, cols: int, mode: str = "spectral", extra: float = 1.0) -> float:
    """The shape-based factor the orthogonalised update of a ``[rows, cols]`` matrix is scaled by
    (Megatron-Core's ``get_muon_scale_factor`` modes, times ``extra``).

    Raises:
        ValueError: an unknown mode, naming ``optimizer.muon_scale_mode``.
    """
    if mode == "spectral":
        base = math.sqrt(max(rows, cols))
    elif mode == "unit_rms_norm":
        base = math.sqrt(rows / cols)
    elif mode == "shape_scaling":
        base = math.sqrt(max(1.0, rows / cols))
    else:
        raise ValueError(f"optimizer.muon_scale_mode={mode!r} must be one of {list(SCALE_MODES)}")
    return base * extra


def split_logical(full: torch.Tensor, p, split_qkv: bool = True) -> list[torch.Tensor]:
    """The logical matrices inside the full 2-D tensor of ``p`` (module docstring): Q, K, V of a
    grouped fused QKV, the ``stride`` blocks of a strided weight, else the tensor itself."""
    qkv = p.meta.qkv_split
    if qkv is not None and split_qkv:
        groups, rows = qkv
        grouped = full.reshape(groups, sum(rows), full.shape[-1])
        return [t.reshape(-1, full.shape[-1]) for t in grouped.split(list(rows), dim=1)]
    if p.meta.shard.stride > 1:
        return list(full.chunk(p.meta.shard.stride, dim=0))
    return [full]


def join_logical(parts: list[torch.Tensor], p, split_qkv: bool = True) -> torch.Tensor:
    """The inverse of :func:`split_logical`."""
    qkv = p.meta.qkv_split
    if qkv is not None and split_qkv:
        groups, _ = qkv
        cols = parts[0].shape[-1]
        return torch.cat([t.reshape(groups, -1, cols) for t in parts], dim=1).reshape(-1, cols)
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def orthogonalised_update(full: torch.Tensor, p, cfg) -> torch.Tensor:
    """``scale * NS5`` of each logical matrix of ``full`` (the full ``U`` of ``p``), joined back
    into the full layout: the update before ``-lr``."""
    parts = []
    for m in split_logical(full, p, cfg.muon_split_qkv):
        o = newton_schulz(m, cfg.muon_num_ns_steps)
        parts.append(o * scale_factor(m.shape[0], m.shape[1], cfg.muon_scale_mode, cfg.muon_extra_scale_factor))
    return join_logical(parts, p, cfg.muon_split_qkv)


class MuonStep:
    """The Muon half of :class:`~paratron.optim.optimizer.Optimizer`'s step under
    ``optimizer.name = "muon"`` (the AdamW half runs on the other params' views).

    Args:
        opt: the optimizer: its ``ddp``, ``ctx``, ``cfg``, ``segments`` and ``pieces``.
        momentum: ``id(piece) -> `` the 1-D momentum view of each Muon piece (``hi - lo`` long).
    """

    def __init__(self, opt, momentum: dict[int, torch.Tensor]) -> None:
        self.opt = opt
        self.momentum = momentum
        self.pieces = [pc for pc in opt.pieces if id(pc) in momentum]
        self._regions = self._build_regions()

    def _build_regions(self) -> list[tuple[int, object, list]]:
        """Per segment holding (or, with ZeRO, sharing a bucket with) a Muon matrix:
        ``(segment index, bucket or None, the bucket's/segment's Muon params)``."""
        opt, ddp = self.opt, self.opt.ddp
        out = []
        for si, seg in enumerate(opt.segments):
            buf = ddp.buffers[seg.buffer]
            if ddp.zero >= 1 and buf.group.size > 1:
                bucket = next(b for b in buf.buckets if b.start <= seg.start < b.end)
                params = [p for p in bucket.params if uses_muon(p)]
            else:
                bucket = None
                params = [p for p in buf.params if uses_muon(p)
                          and seg.start <= buf.index[id(p)][0] < seg.end]
            if params:
                out.append((si, bucket, params))
        return out

    def step(self, lr: float) -> None:
        """One Muon step of every Muon matrix on this rank (every rank of the model-parallel and
        DP groups must call it: it runs their collectives)."""
        c = self.opt.cfg
        updates = self._local_updates(c.muon_momentum, c.muon_use_nesterov)
        for si, bucket, params in self._regions:
            seg = self.opt.segments[si]
            buf = self.opt.ddp.buffers[seg.buffer]
            base, region = self._full_region(si, bucket, updates[si])
            out = torch.zeros_like(region)
            for p in self._assigned(params, buf):
                s, e = buf.index[id(p)]
                local = region[s - base:e - base].view(buf.shapes[id(p)])
                full = orthogonalised_update(self._gather_tp(local, p), p, c)
                out[s - base:e - base] = full[p.meta.shard.slices()].reshape(-1)
            self._apply(si, self._share(si, bucket, out), lr, float(c.weight_decay))

    def _assigned(self, params: list, buf) -> list:
        """The matrices of a region this rank orthogonalises: whole matrices split over the
        buffer's DP group, greedily by Newton-Schulz cost (``numel * min(shape)``), the same
        choice on every rank (TP peers share their DP rank, so they gather the same matrices)."""
        g = buf.group
        if g.size == 1:
            return params
        load = [0] * g.size
        mine = []
        for p in params:
            shape = p.meta.shard.global_shape
            r = min(range(g.size), key=lambda k: (load[k], k))
            load[r] += shape[0] * shape[1] * min(shape)
            if r == max(g.rank, 0):
                mine.append(p)
        return mine

    def _share(self, si: int, bucket, out: torch.Tensor) -> torch.Tensor:
        """Hand every DP rank the orthogonalised updates of its segment: a reduce-scatter of the
        bucket (ZeRO) or an all-reduce of the buffer (replicas); each element is non-zero on one
        rank only, so the sum is exact. Returns the segment's flat update."""
        seg = self.opt.segments[si]
        group = self.opt.ddp.buffers[seg.buffer].group
        if bucket is not None:
            shard = torch.empty(seg.end - seg.start, dtype=out.dtype, device=out.device)
            group.reduce_scatter_into(shard, out)
            return shard
        group.all_reduce(out)
        return out

    def _local_updates(self, beta: float, nesterov: bool) -> dict[int, torch.Tensor]:
        """Advance the momentum of the owned Muon pieces; ``U`` per segment of a region, as a
        flat tensor of the segment's length (zero outside Muon pieces)."""
        opt = self.opt
        out = {si: torch.zeros(opt.segments[si].end - opt.segments[si].start, dtype=torch.float32,
                               device=opt.segments[si].grad.device) for si, _, _ in self._regions}
        if not self.pieces:
            return out
        moms = [self.momentum[id(pc)] for pc in self.pieces]
        grads = [opt.segments[pc.segment].grad[pc.at:pc.at + pc.hi - pc.lo] for pc in self.pieces]
        moms32 = [m.float() for m in moms] if moms[0].dtype != torch.float32 else moms
        torch._foreach_lerp_(moms32, grads, 1.0 - beta)
        if moms32 is not moms:
            torch._foreach_copy_(moms, moms32)
        for pc, g, m in zip(self.pieces, grads, moms32):
            dst = out[pc.segment][pc.at:pc.at + pc.hi - pc.lo]
            dst.copy_(torch.lerp(g, m, beta) if nesterov else m)
        return out

    def _full_region(self, si: int, bucket, update: torch.Tensor) -> tuple[int, torch.Tensor]:
        """``(buffer offset, flat U)`` of the segment's whole bucket (ZeRO: all-gathered over the
        DP group) or of the segment itself."""
        if bucket is None:
            return self.opt.segments[si].start, update
        buf = self.opt.ddp.buffers[self.opt.segments[si].buffer]
        full = torch.empty(bucket.numel, dtype=update.dtype, device=update.device)
        buf.group.all_gather_into(full, update)
        return bucket.start, full

    def _gather_tp(self, local: torch.Tensor, p) -> torch.Tensor:
        ctx = self.opt.ctx
        group = ctx.expert_tp if p.meta.is_expert else ctx.tp
        return gather_full(local, p, group)

    def _apply(self, si: int, update: torch.Tensor, lr: float, wd: float) -> None:
        """``W <- W (1 - lr wd) - lr O`` on the Muon pieces this rank owns in segment ``si``
        (``update``: the segment's flat ``O``)."""
        seg = self.opt.segments[si]
        for pc in self.pieces:
            if pc.segment != si:
                continue
            n = pc.hi - pc.lo
            main = seg.main[pc.at:pc.at + n]
            if wd:
                main.mul_(1.0 - lr * wd)
            main.add_(update[pc.at:pc.at + n], alpha=-lr)
