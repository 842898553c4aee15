"""Memory per rank: model states by ZeRO level plus the activations the schedule keeps in flight.

Model states (Rajbhandari et al. 2020, "ZeRO", section 3.1 and 5): with mixed precision each
parameter costs its bf16 copy (2 bytes), an fp32 main grad (4; paratron's grad buffers are fp32),
an fp32 main weight (4) and two fp32 Adam moments (8); in fp32 the main weight is the parameter
itself (4 + 4 + 8). ZeRO-1 shards the main weights and moments over the ``dp * cp`` ranks (and
keeps, beside the full grad buffer, the reduced fp32 shard of it: ``4 / (dp * cp)`` more, as
``paratron dryrun`` measured), ZeRO-2 also the grads, ZeRO-3 also the parameters.

Activations held per layer per microbatch (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4: the tensors each op saves for backward,
``T = b s / cp`` tokens, ``a`` bytes per element), as paratron's layer saves them:

* norm inputs ``2 T h`` x 8 bytes for RMSNorm (its fp32 input and output), x 4 for LayerNorm (its fp32
  input) (``/tp`` under sequence parallelism; :func:`norm_saved_bytes`), the gathered inputs of the QKV and
  first MLP linears ``2 T h a`` (kept whole, see ``layers/linear.py``), the QKV output
  ``T (n + 2g) d a / tp`` (V is a view of it), RoPE's rotated Q and K ``2 T (n + g) d a / tp`` (without
  RoPE, under GQA, the copy of Q reshaped out of the QKV output, ``T n d a / tp``), the
  attention output ``T n d a / tp``, the attention log-sum-exp ``8 T n / tp``, and the MLP
  ``2 T f a / tp`` (GELU: fc1 output and activation) or ``4 T f a / tp`` (SwiGLU: gate, up, silu,
  product);
* an MoE MLP (:func:`moe_mlp_bytes`) in place of the dense one: the experts' ``T k / tp`` rows per
  rank, the router's fp32 tensors, the dispatch's index vectors and reorder buffers, the fp32
  combine (the router keeps its own fp32 copy of the input; no MLP input is gathered);
* an unfused attention core (Megatron 2021) keeps the ``[b, n/tp, s, s]`` softmax output, and with
  dropout its mask and output: ``T n s a (1 or 2.5) / tp`` (their ``5 a s^2 b`` term);
* ``selective`` recompute drops the attention core's tensors (the log-sum-exp or the ``s^2`` term);
  ``full`` keeps only the layer input ``T h a`` (``/tp`` under SP) and rebuilds one layer at a
  time in backward, whose activations are then the transient working set.

Section 4.2 of Korthikanti et al. multiplies one microbatch's activations by the microbatches in
flight; here that count comes from the schedule's action lists for the chosen schedule, per rank
(:func:`paratron.planner.pipeline.flight_states`). The output layer and its loss are one
fused step that keeps the logits' gradient ``T V / tp`` in the activation dtype (its fp32 logits
buffer, ``4 T V / tp``, is a transient of the forward below fp32).

Under zero-bubble schedules (Qi et al. 2023, section 2) a microbatch's ``B`` frees those tensors
but leaves each linear's weight-grad closure holding its input and output grad until the ``W``
(:func:`deferred_weight_grad_bytes`): under sequence parallelism the input of a column-parallel
linear and the output grad of a row-parallel one are the gathered ``[s, b, h]`` tensors, so a
pending ``W`` can hold more than the microbatch's activations did (``paratron dryrun`` measured
ZB-H1 at 1.17-1.33 of a planner that counted activations until the ``W``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .layout import Layout
from .pipeline import Flight
from .shape import Shape


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank: model states, activations held in flight, transient working memory."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient


def expert_dp(lay: Layout) -> int:
    """Ranks holding the same experts, over which ZeRO shards their state: ``tp * cp * dp / ep``
    (the grid's ``expert_dp`` group, expert TP 1)."""
    return max(1, lay.tp * lay.cp * lay.dp // lay.ep)


def state_bytes(params_local: float, lay: Layout, precision: str,
                expert_local: float = 0.0) -> tuple[float, float, float]:
    """(parameter, grad, optimizer-state) bytes of ``params_local`` parameters (module docstring),
    ``expert_local`` of them expert weights: ZeRO shards those over :func:`expert_dp`, the rest
    over ``dp * cp`` (an EP8 x DP8 layout keeps eight times the expert state the dense rule says;
    found by ``paratron dryrun`` on a Mixtral shape)."""
    dense = params_local - expert_local

    def shard(per_param: float) -> float:
        return per_param * (dense / (lay.dp * lay.cp) + expert_local / expert_dp(lay))

    mixed = precision in ("bf16", "fp16")
    per_param = 2 if mixed else 4
    opt_per_param = 12 if mixed else 8
    param, grad = per_param * params_local, 4 * params_local
    opt = shard(opt_per_param) if lay.zero >= 1 else opt_per_param * params_local
    if lay.zero == 1:
        grad += shard(4)  # ZeRO-1 keeps the full buffer and its reduced fp32 shard (optim/zero.py)
    if lay.zero >= 2:
        grad = shard(4)
    if lay.zero >= 3:
        param = shard(per_param)
    return param, grad, opt


def norm_saved_bytes(shape: Shape) -> int:
    """Bytes one norm saves per element of its input, whatever the precision (``layers/norm.py``
    computes in fp32): RMSNorm keeps its fp32 input and normalised output (8), LayerNorm its fp32
    input (4). Measured by ``paratron dryrun``; the planner had counted one copy at the
    activation dtype."""
    return 4 if shape.layernorm else 8


def layer_activation_bytes(shape: Shape, lay: Layout, b: int, a: int, fused: bool) -> tuple[float, float]:
    """(bytes held per microbatch in flight, bytes of the whole layer's saved tensors) of one layer;
    for a model with both dense and MoE layers, of the larger kind (a per-layer bound)."""
    if shape.low_rank:
        whole = low_rank_activation_bytes(shape, lay, b, a)
        stream = shape.h / lay.tp if shape.low_rank_tp == "bottleneck" or lay.sp else shape.h
        return (b * shape.s // lay.cp * stream * a if lay.recompute == "full" else whole), whole
    T, t, h = b * shape.s // lay.cp, lay.tp, shape.h
    hs = h / t if lay.sp else h
    whole = 2 * hs * norm_saved_bytes(shape) / a + h  # norms; the QKV linear's gathered input
    whole += (shape.n + 2 * shape.g) * shape.d / t + shape.n * shape.d / t
    if not shape.learned_pos:
        whole += 2 * (shape.n + shape.g) * shape.d / t
    elif shape.g != shape.n:
        whole += shape.n * shape.d / t  # grouped Q heads are reshaped out of the QKV output: a copy
    if shape.dropout:
        whole += 2 * hs / a  # hidden-dropout masks, one byte each
    mlp = dense_mlp_bytes(shape, t, T, shape.f, a) if shape.has_dense_mlp() else 0.0
    if shape.experts:
        mlp = max(mlp, moe_mlp_bytes(shape, lay, T, a))
    core = 8 * shape.n / t / a if fused else shape.n * shape.s / t * (2.5 if shape.dropout else 1.0)
    whole_bytes = T * (whole + core) * a + mlp
    if lay.recompute == "full":
        return T * hs * a, whole_bytes
    if lay.recompute == "selective":
        return T * whole * a + mlp, whole_bytes
    return whole_bytes, whole_bytes


def dense_mlp_bytes(shape: Shape, t: int, T: int, f: int, a: int) -> float:
    """Bytes a TP-split MLP of width ``f`` saves for ``T`` tokens: its first linear's gathered input
    ``T h a`` and ``3 T f a / t`` (SwiGLU: gate and up, and the product; the activation's
    Function recomputes ``silu``) or ``2 T f a / t`` (GELU: fc1 output and activation)."""
    return T * (shape.h + (3 if shape.swiglu else 2) * f / t) * a


def moe_mlp_bytes(shape: Shape, lay: Layout, T: int, a: int) -> float:
    """Bytes one MoE MLP (``models/moe/layer.py``, all-to-all dispatcher, softmax router) saves for
    the ``T`` tokens of a microbatch on one rank, under balanced routing (as ``paratron dryrun``
    measures them, tensor by tensor):

    * the router, on the rank's ``Tr`` tokens (``T / tp`` under SP, else all ``T``): its fp32 input
      ``4 h``, the softmax output and the logits kept by the log-sum-exp ``2 x 4 E``, the top-k ids
      ``8 k``, the chosen probabilities and their sum ``4 k + 4``, the log-sum-exp ``4``; per
      microbatch the fp32 copy of a bf16 weight ``4 E h`` and the gathered statistics ``4 (2E + 1)``;
    * the dispatched rows: each TP rank sends its ``T / tp`` tokens' ``R = T k / tp`` pairs, so its
      experts receive ``R`` rows (balanced); four int64 index vectors ``32 R``, the experts' input
      and the combine's two reorder buffers ``3 R h a``, and the experts' inner tensors ``4 R f_e a``
      (SwiGLU) or ``2 R f_e a`` (GELU);
    * the combine ``(slots.float() * probs)`` on ``Tr`` tokens: fp32 slots ``4 Tr k h`` and probs ``4 Tr k``;
    * a shared expert: a dense MLP of width ``shared_f`` (:func:`dense_mlp_bytes`); its gate keeps
      its sigmoid and the shared output ``Tr (h + 1) a`` and, under SP, its own input ``Tr h a``.

    Capacity dropping, padding to capacity and routing imbalance are not modelled.
    """
    t, h, E, k = lay.tp, shape.h, shape.experts, shape.top_k
    sp = lay.sp and t > 1
    Tr, R = (T / t if sp else T), T * k / t
    out = Tr * (4 * h + 8 * E + 12 * k + 8) + 4 * (2 * E + 1) + (4 * E * h if a < 4 else 0)
    out += R * (32 + 3 * h * a + (4 if shape.swiglu else 2) * shape.expert_f * a)
    out += Tr * k * (4 * h + 4)
    if shape.shared_f:
        out += dense_mlp_bytes(shape, t, T, shape.shared_f, a)
    if shape.shared_f and shape.shared_gate:
        out += Tr * (h + 1) * a + (Tr * h * a if sp else 0)
    return out


def low_rank_activation_bytes(shape: Shape, lay: Layout, b: int, a: int) -> float:
    """Bytes one low-rank layer (``paratron/models/low_rank.py``, docs/boost.md) saves for the
    backward of one microbatch.

    Under ``model.low_rank_recompute`` (bottleneck plan): exactly the recomputed pieces' inputs,
    the layer input and mid-layer residual ``2 T h a / tp``, the two fp32 per-token sums of squares
    ``8 T`` and the summed bottlenecks ``T (3 + 1 + 2 + 1) r a`` (SwiGLU; GELU ``6r``) (measured in
    ``tests/test_boost.py``). Otherwise an estimate: each norm's input and output, the attention
    tensors (q, k, v, the rotated q and k, output, log-sum-exp) and the MLP's (inner outputs and
    activation), split by heads and ``f`` under ``bottleneck`` and whole under ``naive`` (its
    attention and activation run replicated), plus every bottleneck before and after its silu
    (``r/tp`` wide under ``naive``).
    """
    T, t, h, r = b * shape.s // lay.cp, lay.tp, shape.h, shape.low_rank
    bottlenecks = (3 + 1 + (2 if shape.swiglu else 1) + 1) * r
    split = t if shape.low_rank_tp == "bottleneck" else 1
    if shape.low_rank_recompute:
        return T * (2 * h / t * a + 8 + bottlenecks * a)
    hs = h / t if shape.low_rank_tp == "bottleneck" or lay.sp else h
    qkv, nd = (shape.n + 2 * shape.g) * shape.d / split, shape.n * shape.d / split
    elems = 4 * hs + qkv + 2 * (shape.n + shape.g) * shape.d / split + nd + 8 * shape.n / split / a
    elems += (3 if shape.swiglu else 2) * shape.f / split + 2 * bottlenecks / (t if split == 1 else 1)
    return T * elems * a


def head_bytes(shape: Shape, lay: Layout, b: int, a: int) -> tuple[float, float]:
    """(held, transient) bytes of the final norm and the fused output layer + loss for one
    microbatch (``layers/cross_entropy.py``'s ``fused_linear_cross_entropy``): it keeps its
    gathered input ``T h a`` and the logits' gradient ``T V_pad a / tp`` in the activation dtype;
    the forward's fp32 logits buffer ``4 T V_pad / tp`` is that gradient itself in fp32 and a
    transient beside it otherwise."""
    T = b * shape.s // lay.cp
    vocab = T * shape.padded_vocab(lay.tp) / lay.tp
    hs = shape.h / lay.tp if lay.sp else shape.h
    return T * (hs * norm_saved_bytes(shape) + shape.h * a) + vocab * a, (0.0 if a >= 4 else 4.0 * vocab)


def deferred_weight_grad_bytes(shape: Shape, lay: Layout, b: int, a: int) -> float:
    """Bytes the weight-grad closures of one layer hold for one microbatch from its ``B`` to its
    ``W`` (``layers/linear.py``'s ``_weight_grads``: ``x`` and ``dy`` of each linear; weights are
    not counted), ``T = b s / cp`` tokens, ``a`` bytes per element:

    * a column-parallel linear (QKV, the first MLP linear) keeps its gathered input ``T h a``
      (whole on every TP rank, with or without SP) and its output grad ``T out a / tp``;
    * a row-parallel one (attention projection, second MLP linear) keeps its input
      ``T in a / tp`` and its output grad ``T h a`` (all-gathered under SP), and under SP with a
      bias also the local output grad its bias grad sums, ``T h a / tp``;
    * an MoE layer's experts (``local_linear``) keep, for their ``R = T k / tp`` rows, the inputs
      and output grads of both linears, ``R (2 h + (3 or 2) f_e) a``, and a shared expert what a
      dense MLP keeps. The router's weight grad flows through autograd (not deferred).

    Low-rank (CoLA) layers are not modelled (0)."""
    if shape.low_rank:
        return 0.0
    T, t, h = b * shape.s // lay.cp, lay.tp, shape.h
    bias_dy = h / t if lay.sp and t > 1 and shape.bias else 0.0

    def mlp(f: int) -> float:  # fc1 (column, SwiGLU's gate and up fused) and fc2 (row)
        return h + (2 if shape.swiglu else 1) * f / t + f / t + h + bias_dy

    attn = h + (shape.n + 2 * shape.g) * shape.d / t + shape.n * shape.d / t + h + bias_dy
    dense = mlp(shape.f) if shape.has_dense_mlp() else 0.0
    moe = 0.0
    if shape.experts:
        R = T * shape.top_k / t
        moe = R / T * (2 * h + (3 if shape.swiglu else 2) * shape.expert_f) + (mlp(shape.shared_f) if shape.shared_f else 0)
    return T * (attn + max(dense, moe)) * a


def head_deferred_bytes(shape: Shape, lay: Layout, b: int, a: int) -> float:
    """Bytes the output layer's weight-grad closure holds for one microbatch until its ``W``: its
    gathered input ``T h a`` and the logits' grad ``T V_pad a / tp`` (in the activation dtype)."""
    T = b * shape.s // lay.cp
    return T * (shape.h + shape.padded_vocab(lay.tp) / lay.tp) * a


def held_activation_bytes(shape: Shape, lay: Layout, layers_per_chunk: int, in_flight: int, has_head: bool,
                          a: int, fused: bool = True, pending: int = 0) -> tuple[float, float]:
    """(activation bytes saved for backward at one point of the schedule, transient bytes of the
    loss or of one recomputed layer) on one rank (see :func:`rank_memory`), ``in_flight``
    (microbatch, chunk) activations alive and ``pending`` deferred weight grads queued; the first
    is what ``paratron dryrun`` measures with its saved-tensor hooks and weight-grad closures."""
    held, whole = layer_activation_bytes(shape, lay, lay.mbs, a, fused)
    acts = held * layers_per_chunk * in_flight
    if pending:
        acts += deferred_weight_grad_bytes(shape, lay, lay.mbs, a) * layers_per_chunk * pending
    transient = whole if lay.recompute == "full" else 0.0
    if has_head:
        h_held, h_trans = head_bytes(shape, lay, lay.mbs, a)
        acts += h_held * max(1 if not pending else 0, -(-in_flight // lay.vpp))
        if pending:
            acts += head_deferred_bytes(shape, lay, lay.mbs, a) * -(-pending // lay.vpp)
        transient = max(transient, h_trans)
    return acts, transient


def peak_activation_bytes(shape: Shape, lay: Layout, layers_per_chunk: int, flight: Flight, has_head: bool,
                          a: int, fused: bool = True) -> tuple[float, float]:
    """:func:`held_activation_bytes` at the schedule's worst ``(alive, pending)`` point of
    ``flight`` (:func:`paratron.planner.pipeline.flight_states`), and its transient bytes."""
    return max((held_activation_bytes(shape, lay, layers_per_chunk, alive, has_head, a, fused, pending)
                for alive, pending in flight), key=lambda held: held[0])


def rank_memory(shape: Shape, lay: Layout, params_local: float, layers_per_chunk: int, flight: Flight,
                has_head: bool, precision: str, a: int, fused: bool = True, expert_local: float = 0.0) -> Memory:
    """Bytes of one rank holding ``params_local`` parameters and, at the worst point of
    ``flight``, its (microbatch, chunk) activations of ``layers_per_chunk`` layers each alive
    and its deferred weight grads pending (the last stage also its head's, for the microbatches
    of its last chunk).

    The peak is either during a backward (activations + the transient of the loss or of one
    recomputed layer) or during the optimizer step (Adam's ``sqrt(v) + eps`` denominator, one fp32
    buffer of the rank's optimizer shard, ``optim/update_rules.py``), whichever is larger.
    """
    param, grad, opt = state_bytes(params_local, lay, precision, expert_local)
    acts, transient = peak_activation_bytes(shape, lay, layers_per_chunk, flight, has_head, a, fused)
    step_peak = opt / (3 if precision in ("bf16", "fp16") else 2)  # one fp32 buffer per param of the shard
    if step_peak > acts + transient:
        acts, transient = 0.0, step_peak
    return Memory(param, grad, opt, acts, transient)
