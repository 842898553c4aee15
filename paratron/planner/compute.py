"""Compute: seconds of one microbatch's forward (F), input-gradient backward (B) and weight-gradient
(W) passes through each pipeline stage.

Each GEMM of a layer (per TP rank; Shoeybi et al. 2019 split, shapes ``[m, k] x [k, n]``) costs the
roofline of Williams et al. 2009 ("Roofline", CACM), plus a fixed per-kernel cost::

    t = max(2 m' n' k' / (peak x eta), (m k + k n + m n) a / mem_bw) + overhead

where ``m' n' k'`` are the dimensions rounded up to the GEMM tile (tile quantisation: a partly
filled tile costs a whole one), ``eta`` is the device's large-GEMM efficiency and ``a`` the bytes
per element. The efficiency factor the issue asks for is thus a function of the GEMM shape:
``eta x (m n k) / (m' n' k')`` when compute-bound, lower when memory-bound (small GEMMs).
Backward: the input gradient ``[m, n] x [n, k]`` and the weight gradient ``[k, m] x [m, n]`` have
the forward's FLOPs each (so training is 3x the forward, Narayanan et al. 2021, appendix).

Attention scores and weighted sum are batched GEMMs over ``b n / tp`` heads; a fused causal kernel
(flash attention, what ``F.scaled_dot_product_attention`` runs) skips the masked half; the unfused
one (Megatron 2021) computes it whole and moves the ``[b, n, s, s]`` scores through softmax and
dropout in memory. Norms, residual adds, activations, RoPE and dropout are memory-bound: their
bytes moved / ``mem_bw`` (backward: twice the forward's bytes). Recompute (Korthikanti et al.
2022, section 5): ``full`` adds the layer's forward to B, ``selective`` the attention core's.
TP, CP and EP collectives run inside F and B (they block the next GEMM); their seconds come from
:mod:`.communication`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import communication as comm
from .hardware import Cluster, Hardware
from .layout import Layout
from .shape import Shape

OPS_FORWARD = 30
"""Kernels per layer forward in paratron's layer (norms, linears, RoPE, SDPA, activation, adds)."""
OPS_BACKWARD = 45


@dataclass(frozen=True)
class Work:
    """Seconds of one microbatch through one stage: forward, input-grad backward, weight-grad."""

    F: float
    B: float
    W: float

    def __add__(self, o: "Work") -> "Work":
        return Work(self.F + o.F, self.B + o.B, self.W + o.W)

    def scaled(self, k: float) -> "Work":
        return Work(self.F * k, self.B * k, self.W * k)


ZERO = Work(0.0, 0.0, 0.0)


def gemm_seconds(m: int, n: int, k: int, hw: Hardware, batch: int = 1, work_fraction: float = 1.0) -> float:
    """Roofline seconds of ``batch`` GEMMs ``[m, k] x [k, n]`` (module docstring)."""
    tm, tn, tk = hw.tile
    padded = math.ceil(m / tm) * tm * math.ceil(n / tn) * tn * math.ceil(k / tk) * tk
    t_flops = 2.0 * padded * batch * work_fraction / (hw.peak_flops * hw.gemm_efficiency)
    t_bytes = batch * (m * k + k * n + m * n) * hw.act_bytes / hw.mem_bandwidth
    return max(t_flops, t_bytes) + hw.op_overhead


def _gemm_work(shapes: list[tuple[int, int, int, int]], hw: Hardware) -> Work:
    f = sum(gemm_seconds(m, n, k, hw, c) for m, n, k, c in shapes)
    b = sum(gemm_seconds(m, k, n, hw, c) for m, n, k, c in shapes)
    w = sum(gemm_seconds(k, n, m, hw, c) for m, n, k, c in shapes)
    return Work(f, b, w)


def layer_gemms(shape: Shape, lay: Layout, b: int, layer: int) -> list[tuple[int, int, int, int]]:
    """Weight GEMMs ``(m, n, k, count)`` of one layer's forward on one rank."""
    T, h, t = b * shape.s // lay.cp, shape.h, lay.tp
    if shape.low_rank:  # A [r, in] and B [out, r] per projection; either plan splits one of each by t
        r = shape.low_rank
        return [g for i, o in shape.low_rank_widths() for g in ((T, r, i // t, 1), (T, o // t, r, 1))]
    out = [(T, (shape.n + 2 * shape.g) * shape.d // t, h, 1), (T, h, shape.n * shape.d // t, 1)]
    mats = 2 if shape.swiglu else 1
    if shape.is_moe(layer):
        local = max(shape.experts // lay.ep, 1)
        rows = max(T * shape.top_k * lay.ep // shape.experts, 1)
        out += [(rows, shape.expert_f, h, mats * local), (rows, h, shape.expert_f, local)]
        if shape.shared_f:
            out += [(T, shape.shared_f // t, h, mats), (T, h, shape.shared_f // t, 1)]
    else:
        out += [(T, shape.f // t, h, mats), (T, h, shape.f // t, 1)]
    return out


def attention_core(shape: Shape, lay: Layout, b: int, hw: Hardware, fused: bool) -> tuple[float, float]:
    """(forward seconds, elementwise bytes) of scores, softmax and weighted sum of one layer."""
    sq, heads = shape.s // lay.cp, b * shape.n // lay.tp
    frac = 0.5 if fused else 1.0  # a fused causal kernel skips the masked half
    t = (gemm_seconds(sq, shape.s, shape.d, hw, heads, frac) + gemm_seconds(sq, shape.d, shape.s, hw, heads, frac))
    # Unfused: scale+mask+softmax read and write the scores, dropout reads, writes and keeps a mask.
    scores_bytes = 0.0 if fused else heads * sq * shape.s * (4 + (2.5 if shape.dropout else 0)) * hw.act_bytes
    return t, scores_bytes


def elementwise_bytes(shape: Shape, lay: Layout, b: int) -> float:
    """Bytes moved by one layer's memory-bound ops in forward (norms, adds, activation, RoPE, dropout)."""
    T, h = b * shape.s // lay.cp, shape.h
    hs = h / lay.tp if lay.sp else h  # the norm/residual region is sharded under SP
    elems = 4 * hs + 6 * hs  # 2 norms (read + write), 2 residual adds (2 reads + 1 write)
    if shape.dropout:
        elems += 5 * hs
    elems += (5 if shape.swiglu else 2) * shape.f / lay.tp
    if not shape.learned_pos:
        elems += 6 * (shape.n + shape.g) * shape.d / lay.tp
    return T * elems


def layer_work(shape: Shape, lay: Layout, b: int, layer: int, cluster: Cluster, fused: bool) -> Work:
    """F, B, W seconds of one transformer layer for one microbatch of ``b`` samples on one rank."""
    hw = cluster.hw
    g = _gemm_work(layer_gemms(shape, lay, b, layer), hw)
    attn_t, scores_bytes = attention_core(shape, lay, b, hw, fused)
    elem = (elementwise_bytes(shape, lay, b) * hw.act_bytes + scores_bytes) / hw.mem_bandwidth
    fwd_comm = comm.seconds(comm.tp_layer(shape, lay, b, hw.act_bytes, False)
                            + comm.cp_layer(shape, lay, b, hw.act_bytes, False)
                            + comm.ep_layer(shape, lay, b, hw.act_bytes, layer), lay, cluster)
    bwd_comm = comm.seconds(comm.tp_layer(shape, lay, b, hw.act_bytes, True)
                            + comm.cp_layer(shape, lay, b, hw.act_bytes, True)
                            + comm.ep_layer(shape, lay, b, hw.act_bytes, layer), lay, cluster)
    F = g.F + attn_t + elem + OPS_FORWARD * hw.op_overhead + fwd_comm
    B = g.B + 2 * attn_t + 2 * elem + OPS_BACKWARD * hw.op_overhead + bwd_comm
    if lay.recompute == "full":
        B += F
    elif shape.low_rank_recompute:  # every piece but the collectives runs again (docs/boost.md)
        B += F - fwd_comm
    elif lay.recompute == "selective":
        B += attn_t + scores_bytes / hw.mem_bandwidth
    return Work(F, B, g.W)


def stream_work(shape: Shape, lay: Layout, b: int, cluster: Cluster) -> Work:
    """The low-rank bottleneck plan's all-gathers of the hidden-sharded stream, once per chunk."""
    f, bw = (comm.seconds(comm.low_rank_stream(shape, lay, b, cluster.hw.act_bytes, back), lay, cluster)
             for back in (False, True))
    return Work(f, bw, 0.0)


def embedding_work(shape: Shape, lay: Layout, b: int, cluster: Cluster) -> Work:
    """The input embedding lookup (and learned positions) of the first stage."""
    hw = cluster.hw
    T = b * shape.s // lay.cp
    elem = T * shape.h * hw.act_bytes * (3 if shape.learned_pos else 1) / hw.mem_bandwidth
    c = comm.seconds(comm.embedding_and_head(shape, lay, b, hw.act_bytes, True, False, False), lay, cluster)
    return Work(elem + 2 * hw.op_overhead + c, 2 * elem + 2 * hw.op_overhead, 0.0)


def head_work(shape: Shape, lay: Layout, b: int, cluster: Cluster) -> Work:
    """Final norm, output layer GEMM and vocab-parallel cross-entropy (fp32) of the last stage."""
    hw = cluster.hw
    T, vp = b * shape.s // lay.cp, shape.padded_vocab(lay.tp) // lay.tp
    g = _gemm_work([(T, vp, shape.h, 1)], hw)
    ce = T * vp * 4 * 5 / hw.mem_bandwidth  # fp32 logits: max, exp, sum, gather, write grad
    norm = 2 * T * shape.h * hw.act_bytes / hw.mem_bandwidth
    fwd_c = comm.seconds(comm.embedding_and_head(shape, lay, b, hw.act_bytes, False, True, False), lay, cluster)
    bwd_c = comm.seconds(comm.embedding_and_head(shape, lay, b, hw.act_bytes, False, True, True), lay, cluster)
    ops = 12 * hw.op_overhead
    return Work(g.F + ce + norm + ops + fwd_c, g.B + ce + 2 * norm + ops + bwd_c, g.W)


STAGE_WORK_FREE = {"zero": 0, "schedule": "1f1b"}
"""Layout fields :func:`stage_works` never reads (ZeRO's traffic and the schedule's order are costed
elsewhere), with a value to set them to: the search costs the layouts differing only in them once
(``tests/test_planner_search.py`` checks that reading them would raise)."""


def stage_works(shape: Shape, lay: Layout, cluster: Cluster, fused: bool = True) -> list[Work]:
    """Seconds per microbatch of each virtual stage, in model order (even layer split)."""
    stages = lay.pp * lay.vpp
    per = shape.L // stages
    cache: dict[bool, Work] = {}
    bodies: dict[tuple[bool, ...], Work] = {}  # stages with the same layer kinds sum the same seconds
    stream = stream_work(shape, lay, lay.mbs, cluster)
    works = []
    for st in range(stages):
        kinds = tuple(shape.is_moe(layer) for layer in range(st * per, (st + 1) * per))
        if kinds not in bodies:
            w = ZERO
            for moe in kinds:
                if moe not in cache:
                    cache[moe] = layer_work(shape, lay, lay.mbs, st * per + kinds.index(moe), cluster, fused)
                w = w + cache[moe]
            bodies[kinds] = w + stream
        w = bodies[kinds]
        if st == 0:
            w = w + embedding_work(shape, lay, lay.mbs, cluster)
        if st == stages - 1:
            w = w + head_work(shape, lay, lay.mbs, cluster)
        works.append(w)
    return works
