"""Full logical tensors in and out of model chunks of any TP/PP layout (docs/DESIGN.md principle 5):
each parameter carries its ``logical_name`` and ``shard`` (``paratron.parallel.params``), so
loading is slicing and saving is gathering over TP.
"""

from __future__ import annotations

import torch

from paratron.parallel.context import ParallelContext
from paratron.parallel.params import gather_full, load_full_, unique_params
from paratron.parallel.params import gather_full, unique_params


def load_full_state(chunks, tensors: dict[str, torch.Tensor]) -> set[str]:
    """Copy each parameter's slice of the full tensor ``tensors[param.meta.logical_name]`` into it
    (``params.load_full_``; any TP/PP layout, padding rows left as they are).

    Returns: the logical names used (a pipeline stage uses only its own).
    Raises:
        KeyError: a parameter of these chunks has no tensor (named).
        ValueError: a tensor has the wrong full shape.
    """
    used = set()
    for p in unique_params(chunks):
        name = p.meta.logical_name
        if name not in tensors:
            raise KeyError(f"no tensor for parameter {name!r}")
        load_full_(p, tensors[name])
        used.add(name)
    return used


def gather_full_state(chunks, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """The full logical tensors of these chunks' dense parameters, gathered over TP (vocab padding
    dropped): ``{logical name: tensor}``. Every TP rank of the stage must call it (all-gathers in
    parameter order). Each pipeline stage returns only its own parameters.

    Raises:
        NotImplementedError: an expert parameter (those are split over the expert groups).
    """
    out: dict[str, torch.Tensor] = {}
    for p in unique_params(chunks):
        if p.meta.is_expert:
            raise NotImplementedError(f"{p.meta.logical_name}: gathering expert parameters is not supported here")
        out[p.meta.logical_name] = gather_full(p.detach(), p, ctx.tp).clone()
    return out
