"""How one paratron tensor is made from Hugging Face tensors: the one mapping that both the
offline converter (:func:`paratron.checkpoint.hf.hf_to_paratron`, on full tensors) and the sliced
loader (:mod:`paratron.checkpoint.hf_load`, on the rows a rank owns) follow.

A :class:`Recipe` names its sources, whether each is stored transposed (GPT-2's Conv1D
``[in, out]``), and how the sources are joined along dim 0 (a concatenation, or the per-KV-group
QKV fusion). Every join paratron needs only reorders whole rows, so the join applied to row
*numbers* instead of data (:meth:`Recipe.row_origins`) says where each row of the paratron tensor
lives in the sources; a rank then reads exactly its rows, and no fused layout needs a whole
tensor in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

Join = Callable[[list[torch.Tensor]], torch.Tensor]


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[a; b; ...]`` along dim 0 (SwiGLU's fused ``fc1 = [gate; up]``)."""
    return torch.cat(parts)


@dataclass(frozen=True)
class Recipe:
    """One paratron tensor from Hugging Face tensors.

    Attributes:
        sources: Hugging Face tensor names, in the order ``join`` takes them.
        join: joins the (transposed) sources along dim 0 by reordering whole rows; None: the one
            source as it is.
        transposed: each 2-D source is stored ``[in, out]`` and is transposed first.
        expect: the full shape this tensor must have, when the mapping fixes it apart from the
            model's params (QK-norm weights: ``(head_dim,)``), with ``rule`` saying why.
    """

    sources: tuple[str, ...]
    join: Join | None = None
    transposed: bool = False
    expect: tuple[int, ...] | None = None
    rule: str = ""

    def build(self, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The full tensor from the full sources (``read(name)``).

        Raises:
            ValueError: the result does not have the ``expect`` shape (``rule`` given).
        """
        parts = [read(n) for n in self.sources]
        if self.transposed:
            parts = [p.t() for p in parts]
        out = self.join(parts) if self.join is not None else parts[0]
        if self.expect is not None and tuple(out.shape) != self.expect:
            raise ValueError(f"{self.sources[0]} has shape {tuple(out.shape)}; {self.rule}")
        return out.contiguous()

    def row_origins(self, source_rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each dim-0 row of the joined tensor comes from, given each source's dim-0 size
        (after transposition): ``(source index [R], row in that source [R])``, int64."""
        starts = [0]
        for n in source_rows:
            starts.append(starts[-1] + n)
        ids = [torch.arange(starts[i], starts[i + 1]) for i in range(len(source_rows))]
        joined = self.join(ids) if self.join is not None else ids[0]
        which = torch.searchsorted(torch.tensor(starts[1:]), joined, right=True)
        return which, joined - torch.tensor(starts[:-1])[which]
