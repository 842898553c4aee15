"""Communication: the bytes each parallel axis moves, in the comm ledger's own terms, and their time.

Byte counts follow :class:`paratron.parallel.comm.CommLedger`: per call, the *local input payload*
(all-reduce: the tensor; all-gather: the local shard; reduce-scatter: the full local input;
all-to-all: all bytes sent; p2p: the bytes sent), keyed by ledger op and group name, so the
planner's volumes can be compared with a recorded run
(``tests/test_planner.py::test_communication_bytes_are_the_ledgers``).

Volumes per axis (T = b s / cp tokens of one microbatch, a = bytes per activation element):

* tp, per layer (Shoeybi et al. 2019, section 3): 2 all-reduces of ``T h a`` forward and 2 backward;
  with sequence parallelism (Korthikanti et al. 2022, section 4.2.2) each becomes an all-gather
  (payload ``T h a / tp``) plus a reduce-scatter (payload ``T h a``). Full recompute replays the
  forward's collectives in backward. The vocab-parallel embedding and output layer add one each.
  Low-rank layers (``model.low_rank``) follow :func:`low_rank_tp_layer` and, for the bottleneck
  plan, :func:`low_rank_stream` once per chunk.
* pp: one p2p of the stage boundary activation (``T h a``, ``/tp`` under SP) per microbatch and
  direction (Narayanan et al. 2021, section 2.2).
* dp (group ``dp_cp``): one all-reduce of the fp32 main grads per step; ZeRO >= 1 replaces it by a
  reduce-scatter of the same buffer and an all-gather of the updated parameter shards
  (Rajbhandari et al. 2020, section 5); ZeRO-3 all-gathers the parameters again per microbatch
  forward and backward.
* cp, per layer: ring attention passes each rank's K and V ``cp - 1`` times forward and K, V, dK,
  dV backward (Liu et al. 2023, "Ring Attention", section 3).
* ep, per MoE layer: dispatch and combine all-to-alls of ``T k h a`` forward, and again backward.

Time (Thakur et al. 2005, ring algorithms; ``n`` ranks, bandwidth ``B``, latency ``l`` per step):
all-reduce ``2 (n-1)/n x / B + 2 (n-1) l``; all-gather of a shard ``x``: ``(n-1) x / B + (n-1) l``;
reduce-scatter and all-to-all of an input ``x``: ``(n-1)/n x / B + (n-1) l``; p2p ``x / B + l``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Cluster
from .layout import Layout
from .shape import Shape


@dataclass(frozen=True)
class Transfer:
    """``calls`` collectives of ledger op ``op`` on group ``group``, each of ``nbytes`` payload."""

    group: str
    op: str
    nbytes: float
    calls: int = 1


def collective_seconds(op: str, nbytes: float, n: int, bw: float, latency: float) -> float:
    """Seconds of one ring collective of ``n`` ranks (module docstring); 0 for ``n == 1``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency
    if op == "all_gather":
        return (n - 1) * nbytes / bw + (n - 1) * latency
    if op in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * nbytes / bw + (n - 1) * latency
    return nbytes / bw + latency  # send / recv


def group_geometry(group: str, lay: Layout) -> tuple[int, int]:
    """(size, stride in rank order) of a group under the ``tp-cp-ep-dp-pp`` order."""
    return {"tp": (lay.tp, 1), "cp": (lay.cp, lay.tp), "ep": (lay.ep, lay.tp * lay.cp),
            "dp_cp": (lay.dp * lay.cp, lay.tp), "pp": (lay.pp, lay.tp * lay.cp * lay.dp),
            "embedding": (min(lay.pp, 2), lay.tp * lay.cp * lay.dp * max(lay.pp - 1, 1))}[group]


def seconds(transfers: list[Transfer], lay: Layout, cluster: Cluster) -> float:
    """Total seconds of ``transfers`` run one after another."""
    total = 0.0
    for t in transfers:
        size, stride = group_geometry(t.group, lay)
        bw, lat = cluster.link(size, stride)
        total += t.calls * collective_seconds(t.op, t.nbytes, size, bw, lat)
    return total


def tp_layer(shape: Shape, lay: Layout, b: int, act_bytes: int, backward: bool) -> list[Transfer]:
    """TP collectives of one layer for one microbatch, forward or backward (without recompute)."""
    if lay.tp == 1:
        return []
    if shape.low_rank:
        return low_rank_tp_layer(shape, lay, b, act_bytes, backward)
    x = b * shape.s // lay.cp * shape.h * act_bytes
    if not lay.sp:
        return [Transfer("tp", "all_reduce", x, 2)]
    return [Transfer("tp", "all_gather", x / lay.tp, 2), Transfer("tp", "reduce_scatter", x, 2)]


def low_rank_tp_layer(shape: Shape, lay: Layout, b: int, act_bytes: int, backward: bool) -> list[Transfer]:
    """TP collectives of one low-rank layer (``paratron/models/low_rank.py``, docs/boost.md) for one
    microbatch, forward or backward; the same either way for ``bottleneck``.

    ``naive``: forward, one all-reduce of each projection group's full output (q|k|v, proj,
    the MLP's inner, fc2); backward, one all-reduce of each group's input grad (``h``, ``n d``,
    ``h``, ``f``). Under SP the groups at the residual stream all-gather their input (``T h / tp``;
    backward: reduce-scatter ``T h``) and reduce-scatter their output (backward: all-gather).
    ``bottleneck``: one all-reduce of the fp32 per-token sum of squares per norm (``T * 4`` bytes,
    2 norms) and one of each r-wide bottleneck: ``3r`` (q|k|v), ``r`` (proj), ``2r`` or ``r``
    (the MLP's inner), ``r`` (fc2), each way.
    """
    T, h, r = b * shape.s // lay.cp, shape.h, shape.low_rank
    inner = 2 if shape.swiglu else 1
    if shape.low_rank_tp == "bottleneck":
        return [Transfer("tp", "all_reduce", T * 4, 2)] + [
            Transfer("tp", "all_reduce", T * w * r * act_bytes) for w in (3, 1, inner, 1)]
    x, nd, f = T * h * act_bytes, shape.n * shape.d, shape.f
    qkv = (shape.n + 2 * shape.g) * shape.d
    if not backward:
        inside = [Transfer("tp", "all_reduce", T * w * act_bytes) for w in (qkv, inner * f)]
        edge = ([Transfer("tp", "all_gather", x / lay.tp, 2), Transfer("tp", "reduce_scatter", x, 2)] if lay.sp
                else [Transfer("tp", "all_reduce", x, 2)])
        return inside + edge
    inside = [Transfer("tp", "all_reduce", T * w * act_bytes) for w in (nd, f)]
    edge = ([Transfer("tp", "reduce_scatter", x, 2), Transfer("tp", "all_gather", x / lay.tp, 2)] if lay.sp
            else [Transfer("tp", "all_reduce", x, 2)])
    return inside + edge


def low_rank_stream(shape: Shape, lay: Layout, b: int, act_bytes: int, backward: bool) -> list[Transfer]:
    """The bottleneck plan's hidden-sharded stream, once per model chunk and microbatch: the
    all-gather of ``[s, b, h/tp]`` before the final norm (forward) and of its grad at the chunk's
    entry (backward)."""
    if not shape.low_rank or shape.low_rank_tp != "bottleneck" or lay.tp == 1:
        return []
    return [Transfer("tp", "all_gather", b * shape.s // lay.cp * shape.h * act_bytes / lay.tp)]


def cp_layer(shape: Shape, lay: Layout, b: int, act_bytes: int, backward: bool) -> list[Transfer]:
    """Ring-attention K/V passes of one layer (module docstring)."""
    if lay.cp == 1:
        return []
    kv = 2 * b * shape.s // lay.cp * shape.g * shape.d // lay.tp * act_bytes
    return [Transfer("cp", "send", kv * (2 if backward else 1), lay.cp - 1)]


def ep_layer(shape: Shape, lay: Layout, b: int, act_bytes: int, layer: int) -> list[Transfer]:
    """Token dispatch and combine of one MoE layer, forward or backward alike."""
    if not shape.is_moe(layer) or lay.ep == 1:
        return []
    return [Transfer("ep", "all_to_all", b * shape.s // lay.cp * shape.top_k * shape.h * act_bytes, 2)]


def embedding_and_head(shape: Shape, lay: Layout, b: int, act_bytes: int, first: bool, last: bool,
                       backward: bool) -> list[Transfer]:
    """TP collectives of the vocab-parallel embedding (first stage) and output layer + loss (last)."""
    if lay.tp == 1:
        return []
    tokens = b * shape.s // lay.cp
    x = tokens * shape.h * act_bytes
    out = []
    if first and not backward:
        out.append(Transfer("tp", "reduce_scatter" if lay.sp else "all_reduce", x))
    if first and backward and lay.sp:  # the reduce-scatter's backward gathers the grad
        out.append(Transfer("tp", "all_gather", x / lay.tp))
    if last and not backward:
        if lay.sp:
            out.append(Transfer("tp", "all_gather", x / lay.tp))
        out += [Transfer("tp", "all_reduce", tokens * 4), Transfer("tp", "all_reduce", tokens * 8)]
    if last and backward:
        out.append(Transfer("tp", "reduce_scatter" if lay.sp else "all_reduce", x))
    return out


def p2p_bytes(shape: Shape, lay: Layout, b: int, act_bytes: int) -> float:
    """Bytes of one stage-boundary activation (or its gradient)."""
    x = b * shape.s // lay.cp * shape.h * act_bytes
    return x / lay.tp if lay.sp else x


def dp_step(lay: Layout, params_local: float, param_bytes: int) -> list[Transfer]:
    """Gradient reduction and (ZeRO >= 1) parameter all-gather of one step, fp32 main grads."""
    n = lay.dp * lay.cp
    if n == 1:
        return []
    grads = params_local * 4
    if lay.zero == 0:
        return [Transfer("dp_cp", "all_reduce", grads)]
    return [Transfer("dp_cp", "reduce_scatter", grads), Transfer("dp_cp", "all_gather", params_local * param_bytes / n)]


def zero3_microbatch(lay: Layout, params_local: float, param_bytes: int) -> list[Transfer]:
    """ZeRO-3: the parameters are all-gathered for the forward and again for the backward."""
    n = lay.dp * lay.cp
    if lay.zero < 3 or n == 1:
        return []
    return [Transfer("dp_cp", "all_gather", params_local * param_bytes / n, 2)]


def tied_embedding_step(shape: Shape, lay: Layout) -> list[Transfer]:
    """The all-reduce of the tied embedding's fp32 grad between the first and last stage."""
    if not shape.tied or lay.pp == 1:
        return []
    return [Transfer("embedding", "all_reduce", shape.padded_vocab(lay.tp) // lay.tp * shape.h * 4)]
