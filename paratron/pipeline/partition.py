"""Which transformer layers each (pipeline rank, model chunk) holds.

The even split gives each of the ``p*v`` virtual stages ``num_layers / (p*v)`` layers. An explicit
layout (``parallel.pipeline_layout``) lists the layers per virtual stage in model order, e.g.
``[1, 3, 3, 1]`` for fewer layers on the first and last stage, which also carry the embedding and
the loss; zeros are allowed (a stage with the embedding or the head only). The stage -> rank map
is the schedule's placement, so a V-shaped schedule (zbv) gets the V split.
"""

from __future__ import annotations

from .registry import get_schedule


def stage_sizes(num_layers: int, p: int, v: int = 1, layout: list[int] | None = None) -> list[int]:
    """Transformer layers per virtual stage (``p * v`` of them), in model order.

    Raises:
        ValueError: ``p`` or ``v`` below 1; a layout of the wrong length, with negative entries or
            not summing to ``num_layers``; or no layout and ``num_layers`` not divisible by ``p * v``.
    """
    if p < 1 or v < 1:
        raise ValueError(f"parallel.pipeline={p} and parallel.virtual_pipeline={v} must be >= 1")
    stages = p * v
    if layout is not None:
        layout = [int(x) for x in layout]
        if len(layout) != stages:
            raise ValueError(f"parallel.pipeline_layout={layout} has {len(layout)} entries; it needs "
                             f"parallel.pipeline*virtual_pipeline = {stages}")
        if min(layout, default=0) < 0 or sum(layout) != num_layers:
            raise ValueError(f"parallel.pipeline_layout={layout} must be non-negative and sum to "
                             f"model.num_layers={num_layers}")
        return layout
    if num_layers % stages:
        raise ValueError(f"model.num_layers={num_layers} is not divisible by parallel.pipeline*virtual_pipeline"
                         f" = {p}*{v} = {stages}; set parallel.pipeline_layout for an uneven split")
    return [num_layers // stages] * stages


def stage_layers(num_layers: int, p: int, v: int = 1, layout: list[int] | None = None,
                 schedule: str = "1f1b") -> dict[tuple[int, int], tuple[int, int]]:
    """Map ``(pipeline rank, local chunk) -> (first layer, number of layers)``, in model order.

    Local chunk ``c`` of a rank is its ``c``-th smallest stage under the schedule's placement
    (:mod:`.placement`), the same order the runtime expects its ``chunks`` list in.

    Raises:
        ValueError: see :func:`stage_sizes`; an unknown schedule; a placement that does not fit v.
    """
    sizes = stage_sizes(num_layers, p, v, layout)
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    table = get_schedule(schedule).placement(p, v)
    where = {s: (r, c) for r, stages in enumerate(table) for c, s in enumerate(stages)}
    # In model order, so that stages with zero layers at one boundary keep their order for readers
    # that sort by layer range (paratron.models.gpt.model_order breaks ties by insertion order).
    return {where[s]: (starts[s], sizes[s]) for s in range(p * v)}


def chunk_stages(p: int, v: int, schedule: str, pp_rank: int) -> list[int]:
    """The virtual stages held by ``pp_rank``, ascending (its local chunks in order)."""
    return get_schedule(schedule).placement(p, v)[pp_rank]
