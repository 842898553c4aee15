"""The planner's prediction for one rank of a config, term by term, beside the dry run's figures.

The planner (:mod:`paratron.planner.memory`) predicts per pipeline rank; ranks of one stage hold
the same sizes. Its optimizer term holds the main params and the moments together; the dry run
reports them apart, and :func:`compare` sums them for the ratio.
"""

from __future__ import annotations

import dataclasses

from paratron.planner.estimate import rank_expert_params, rank_params, stage_ranks
from paratron.planner.layout import Layout
from paratron.planner.memory import peak_activation_bytes, rank_memory, state_bytes
from paratron.planner.pipeline import ScheduleCache
from paratron.planner.shape import Shape


def layout_of(cfg, world_size: int) -> Layout:
    """The planner's :class:`Layout` of ``cfg``'s parallel section at ``world_size`` ranks."""
    p = cfg.parallel
    dp = world_size // (p.tensor * p.context * p.pipeline)
    return Layout(tp=p.tensor, pp=p.pipeline, vpp=p.virtual_pipeline, dp=dp, cp=p.context, ep=p.expert,
                  zero=p.zero, schedule=p.schedule, mbs=cfg.train.micro_batch_size, recompute=cfg.model.recompute,
                  sp=p.sequence_parallel, cp_algo=p.context_algorithm)


def act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def predict(cfg, world_size: int, pp_rank: int, cache: ScheduleCache | None = None) -> dict[str, float]:
    """Planner bytes of pipeline rank ``pp_rank``: ``params``, ``grads``, ``optimizer`` (main
    params + state), ``activations`` (saved for backward, and held by deferred weight grads, at
    the schedule's peak), ``transient``
    (the loss's or a recomputed layer's working memory) and ``total`` (the planner's peak,
    which may instead be the optimizer step's)."""
    lay = layout_of(cfg, world_size)
    model = dataclasses.replace(cfg.model)
    shape = Shape.of(model, model.seq_length)
    params_local = rank_params(shape, lay)[pp_rank]
    expert_local = rank_expert_params(shape, lay)[pp_rank]
    m = lay.microbatches(cfg.train.global_batch_size)
    cache = cache or ScheduleCache()
    flight = cache.flight(lay.schedule, lay.pp, m, lay.vpp)[pp_rank]
    last = stage_ranks(lay)[-1] == pp_rank
    prec = cfg.train.precision
    per_chunk, a = shape.L // (lay.pp * lay.vpp), act_bytes(prec)
    mem = rank_memory(shape, lay, params_local, per_chunk, flight, last, prec, a, fused=True,
                      expert_local=expert_local)
    held, transient = peak_activation_bytes(shape, lay, per_chunk, flight, last, a, fused=True)
    param, grad, opt = state_bytes(params_local, lay, prec, expert_local)
    return {"params": param, "grads": grad, "optimizer": opt, "activations": held, "transient": transient,
            "total": mem.total}


def compare(measured: dict, predicted: dict) -> list[tuple[str, float, float, float | None]]:
    """``(term, dry-run bytes, planner bytes, dry/planner)`` rows for one rank."""
    dry = {"params": measured["params"], "grads": measured["grads"],
           "optimizer": measured["main_params"] + measured["optimizer_state"],
           "activations": measured["peak_activations"]}
    rows = []
    for term, value in dry.items():
        want = predicted[term]
        rows.append((term, float(value), float(want), value / want if want else None))
    return rows
