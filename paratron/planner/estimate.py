"""One plan's cost: step time, throughput, MFU, memory per rank and bubble, from the cost terms.

step time = pipeline makespan (compute with its blocking TP/CP/EP collectives, bubbles and p2p,
:mod:`.pipeline`) + exposed data-parallel gradient reduction (overlapped with the last backward
on GPUs, whose NCCL kernels run beside compute; not on a CPU, where gloo's threads share the
cores) + the tied-embedding all-reduce + the optimizer step (memory-bound: it reads and writes
each local parameter's ~28 bytes of state, :mod:`.memory`) + ZeRO-3 parameter gathers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratron.models.flops import flops_per_token
from paratron.pipeline.placement import rank_of_stage
from paratron.pipeline.registry import get_schedule

from . import communication as comm
from .compute import Work, stage_works
from .hardware import Cluster
from .layout import Layout
from .memory import Memory, rank_memory
from .bound import pipeline_floor
from .pipeline import Flight, PipelineCost, ScheduleCache
from .shape import Shape

OPTIMIZER_BYTES_PER_PARAM = 28
"""Adam step traffic per parameter: read grad, weight, two moments; write weight, moments, copy."""
BUCKET_BYTES = 40 * 2**20


@dataclass(frozen=True)
class Problem:
    """What is being planned: the model, the cluster, the batch, and whether attention is fused."""

    model: object  # paratron.config.ModelConfig, with vocab_size set
    shape: Shape
    cluster: Cluster
    global_batch_size: int
    seq_length: int
    fused_attention: bool = True

    @property
    def precision(self) -> str:
        return self.cluster.hw.precision


@dataclass
class Estimate:
    """The planner's prediction for one layout (seconds, bytes, FLOP/s per device)."""

    layout: Layout
    step_time: float
    tokens_per_second: float
    mfu: float
    tflops_per_device: float
    hw_tflops_per_device: float
    memory: Memory
    memory_rank: int
    bubble: float
    parts: dict[str, float] = field(default_factory=dict)


def rank_params(shape: Shape, lay: Layout) -> list[float]:
    """Parameters held by each pipeline rank (its chunks' layers, embedding, head, final norm)."""
    stages, ranks = lay.pp * lay.vpp, stage_ranks(lay)
    per = shape.L // stages
    emb = shape.padded_vocab(lay.tp) // lay.tp * shape.h + (shape.max_pos * shape.h if shape.learned_pos else 0)
    head = shape.padded_vocab(lay.tp) // lay.tp * shape.h
    out = [0.0] * lay.pp
    shared = shape.tied and ranks[0] == ranks[-1]  # one tensor serves both ends
    kinds: dict[bool, int] = {}  # a layer's parameters depend only on whether it is an MoE layer
    for layer in range(stages * per):
        moe = shape.is_moe(layer)
        if moe not in kinds:
            kinds[moe] = shape.layer_params(layer, lay.tp, lay.ep)
        out[ranks[layer // per]] += kinds[moe]
    out[ranks[0]] += emb
    out[ranks[-1]] += shape.norm_params() + (0 if shared else head)
    return out


def rank_expert_params(shape: Shape, lay: Layout) -> list[float]:
    """Routed-expert parameters held by each pipeline rank (a part of :func:`rank_params`)."""
    stages, ranks = lay.pp * lay.vpp, stage_ranks(lay)
    per = shape.L // stages
    out = [0.0] * lay.pp
    for layer in range(stages * per):
        out[ranks[layer // per]] += shape.expert_params(layer, lay.ep)
    return out


def stage_ranks(lay: Layout) -> list[int]:
    """The pipeline rank of each virtual stage, in model order (the schedule's placement)."""
    of = rank_of_stage(get_schedule(lay.schedule).placement(lay.pp, lay.vpp))
    return [of[st] for st in range(lay.pp * lay.vpp)]


def memory_per_rank(prob: Problem, lay: Layout, flights: list[Flight]) -> tuple[Memory, int]:
    """(largest rank's memory, its pipeline rank); ``flights[r]``: pipeline rank ``r``'s
    ``(alive, pending)`` points (:meth:`ScheduleCache.flight`)."""
    shape, stages = prob.shape, lay.pp * lay.vpp
    params, experts = rank_params(shape, lay), rank_expert_params(shape, lay)
    last = stage_ranks(lay)[-1]
    memo: dict[tuple[float, float, int, bool], Memory] = {}  # most ranks of a pipeline hold the same

    def of(r: int) -> Memory:
        key = (params[r], experts[r], flights[r], r == last)
        if key not in memo:
            memo[key] = rank_memory(shape, lay, params[r], shape.L // stages, flights[r], r == last,
                                    prob.precision, prob.cluster.hw.act_bytes, prob.fused_attention,
                                    experts[r])
        return memo[key]

    mems = [of(r) for r in range(lay.pp)]
    r = max(range(lay.pp), key=lambda i: mems[i].total)
    return mems[r], r


def fixed_seconds(prob: Problem, lay: Layout, works: list[Work]) -> dict[str, float]:
    """Per-step seconds outside the pipeline makespan (module docstring), by name."""
    hw, cl = prob.cluster.hw, prob.cluster
    params = max(rank_params(prob.shape, lay))
    t_dp = comm.seconds(comm.dp_step(lay, params, 2 if prob.precision != "fp32" else 4), lay, cl)
    if hw.name != "cpu" and t_dp > 0:
        window = works[0].B + works[0].W
        t_dp = max(t_dp - window, t_dp * min(1.0, BUCKET_BYTES / (4 * params)))
    m = lay.microbatches(prob.global_batch_size)
    shard = lay.dp * lay.cp if lay.zero >= 1 else 1
    return {
        "dp grad reduction": t_dp,
        "tied embedding": comm.seconds(comm.tied_embedding_step(prob.shape, lay), lay, cl),
        "optimizer": params / shard * OPTIMIZER_BYTES_PER_PARAM / hw.mem_bandwidth + 20 * hw.op_overhead,
        "zero-3 gathers": m * comm.seconds(comm.zero3_microbatch(lay, params, 2), lay, cl),
    }


def lower_bound(prob: Problem, lay: Layout, works: list[Work], fixed: dict[str, float]) -> float:
    """A step time no schedule the validator accepts can beat: the pipeline's floor
    (:func:`.bound.pipeline_floor`) plus the fixed terms."""
    m = lay.microbatches(prob.global_batch_size)
    return (pipeline_floor(works, stage_ranks(lay), m, p2p_seconds(prob, lay), prob.cluster.hw.sharing)
            + sum(fixed.values()))


def p2p_seconds(prob: Problem, lay: Layout) -> float:
    """Seconds of one stage-boundary activation (or gradient) message; 0 without a pipeline."""
    if lay.pp == 1:
        return 0.0
    size = comm.p2p_bytes(prob.shape, lay, lay.mbs, prob.cluster.hw.act_bytes)
    return comm.seconds([comm.Transfer("pp", "send", size)], lay, prob.cluster)


def finish(prob: Problem, lay: Layout, works: list[Work], fixed: dict[str, float], pipe: PipelineCost,
           mem: tuple[Memory, int]) -> Estimate:
    """Assemble the :class:`Estimate` from the costed pieces."""
    step = pipe.makespan + sum(fixed.values())
    tokens = prob.global_batch_size * prob.seq_length / step
    world, peak = prob.cluster.world, prob.cluster.hw.peak_flops
    model_flops = flops_per_token(_with_recompute(prob.model, "none"), prob.seq_length) * tokens / world
    hw_flops = flops_per_token(_with_recompute(prob.model, lay.recompute), prob.seq_length, True) * tokens / world
    m = lay.microbatches(prob.global_batch_size)
    compute = sum(m * (w.F + w.B + w.W) for w in works) / lay.pp
    parts = {"compute (mean rank)": compute, "pipeline bubble and p2p": pipe.makespan - compute, **fixed}
    return Estimate(lay, step, tokens, model_flops / peak, model_flops / 1e12, hw_flops / 1e12, mem[0], mem[1],
                    pipe.bubble, parts)


def _with_recompute(model, recompute: str):
    import dataclasses

    return dataclasses.replace(model, recompute=recompute)


def estimate(prob: Problem, lay: Layout, cache: ScheduleCache, works: list[Work] | None = None,
             fixed: dict[str, float] | None = None, mem: tuple[Memory, int] | None = None) -> Estimate:
    """The full prediction for ``lay`` (simulates its schedule); ``works``, ``fixed`` and ``mem``
    (:func:`memory_per_rank`) when known.

    Raises:
        ScheduleError: the schedule's lists deadlock.
    """
    works = works or stage_works(prob.shape, lay, prob.cluster, prob.fused_attention)
    fixed = fixed or fixed_seconds(prob, lay, works)
    m = lay.microbatches(prob.global_batch_size)
    pipe = cache.makespan(lay.schedule, lay.pp, m, lay.vpp, works, p2p_seconds(prob, lay), prob.cluster.hw.sharing)
    mem = mem or memory_per_rank(prob, lay, cache.flight(lay.schedule, lay.pp, m, lay.vpp))
    return finish(prob, lay, works, fixed, pipe, mem)
