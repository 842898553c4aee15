"""One parallel layout (the choices the planner makes) and its config.

A :class:`Layout` is what ``paratron plan`` enumerates and ranks; :func:`to_config` writes it into
a copy of the base config, so the planner's output is exactly what ``paratron train`` validates.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from paratron.config import Config


@dataclass(frozen=True)
class Layout:
    """Sizes of each parallel axis and the per-step choices.

    Attributes:
        tp, pp, vpp, dp, cp, ep: tensor, pipeline, virtual-pipeline (chunks per rank), data,
            context and expert parallel sizes (``tp * cp * pp * dp`` = world size).
        zero: ``parallel.zero`` level.
        schedule: pipeline schedule registry name.
        mbs: ``train.micro_batch_size``.
        recompute: ``model.recompute``: ``none``, ``selective`` or ``full``.
        sp: ``parallel.sequence_parallel``.
        cp_algo: ``parallel.context_algorithm`` (``ring`` or ``all2all``; only varied when cp > 1).
    """

    tp: int
    pp: int
    vpp: int
    dp: int
    cp: int
    ep: int
    zero: int
    schedule: str
    mbs: int
    recompute: str
    sp: bool
    cp_algo: str = "ring"

    def microbatches(self, global_batch_size: int) -> int:
        """Microbatches per pipeline per step: ``global_batch / (mbs * dp)``."""
        return global_batch_size // (self.mbs * self.dp)

    def short(self) -> str:
        """A one-line name, e.g. ``tp2 pp2 dp1 1f1b mbs4 none sp``."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"v{self.vpp}")
        parts.append(f"dp{self.dp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("a2a" if self.cp_algo == "all2all" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts += [f"z{self.zero}", self.schedule, f"mbs{self.mbs}", self.recompute]
        if self.sp:
            parts.append("sp")
        return " ".join(parts)


def apply(cfg: Config, layout: Layout, global_batch_size: int, seq_length: int, precision: str) -> Config:
    """Set ``layout``'s parallel, batch, recompute and precision fields on ``cfg`` in place."""
    p = cfg.parallel
    p.tensor, p.pipeline, p.virtual_pipeline = layout.tp, layout.pp, layout.vpp
    p.context, p.expert, p.zero, p.schedule = layout.cp, layout.ep, layout.zero, layout.schedule
    p.sequence_parallel, p.pipeline_layout, p.context_algorithm = layout.sp, None, layout.cp_algo
    cfg.train.micro_batch_size, cfg.train.global_batch_size = layout.mbs, global_batch_size
    cfg.train.precision, cfg.model.recompute, cfg.model.seq_length = precision, layout.recompute, seq_length
    return cfg


def to_config(base: Config, layout: Layout, global_batch_size: int, seq_length: int, precision: str) -> Config:
    """A copy of ``base`` with ``layout`` applied (:func:`apply`)."""
    return apply(copy.deepcopy(base), layout, global_batch_size, seq_length, precision)
