"""LoRA adapters on paratron's tensor-parallel linears (Hu et al. 2021, "LoRA", section 4.1).

A target linear ``y = x W^T`` gets ``y += (alpha / r) * dropout(x) A^T B^T`` with ``A [r, in]``
and ``B [out, r]``; ``W`` (and every other param of the model) is frozen. ``B`` starts at zero, so
the adapted model starts equal to the base; ``A`` is Kaiming-normal with gain 1 (fan-in:
``N(0, 1/in)``), drawn per tile like every paratron param (:mod:`paratron.layers.init`), so any TP
layout starts from the same adapters.

Tensor parallelism, as in Megatron-Core/NeMo's parallel LoRA adapters:

* **column-parallel base** (``qkv``, ``fc1``; ``W`` split by output rows): ``A`` is replicated,
  ``B [out/tp, r]`` is split by rows exactly like ``W`` (strided for SwiGLU's ``[gate; up]``),
  so each rank adds the adapter delta of its own output slice. The ``[s, b, r]`` activation
  ``x A^T`` feeds every rank's ``B``, so its grad is summed over TP (``copy_to_tp_region``); then
  ``A``'s grad and the input grad are complete on every rank. Under sequence parallelism ``A``
  runs on the local sequence shard and the small ``[s/tp, b, r]`` result is all-gathered (its
  backward reduce-scatters), so ``A``'s grad is a partial sum over sequence shards: ``A`` is
  marked ``sequence_parallel`` and the grad finalisation sums it over TP, as for norms.
* **row-parallel base** (``proj``, ``fc2``; ``W`` split by input columns): ``A [r, in/tp]`` is
  split by columns like ``W``, the partial ``[s, b, r]`` products are all-reduced (under SP
  reduce-scattered along the sequence), and ``B`` is replicated (marked ``sequence_parallel``
  under SP, its grad then being a sequence-shard partial sum).

Each adapter's collective moves ``s * b * r`` elements, ``r / h`` of the base layer's.

The adapter is a submodule ``<linear>.lora`` (params ``<linear>.lora_A.weight``,
``<linear>.lora_B.weight`` in logical names, as PEFT names them) applied by a forward hook of the
base linear, so the attention and MLP code is unchanged and the base module keeps its type and
attributes. A and B get their grads from autograd (``.grad``), which DDP moves into its buffers.

Fused layouts: a LoRA on the fused ``qkv`` (or ``[gate; up]``) has one ``A`` shared by q, k and v
(gate and up) and one ``B`` whose rows split like ``W``'s. Exported to PEFT as separate q/k/v
(gate/up) adapters with the same ``A`` and ``B`` split by rows it is exactly the same update
(:mod:`paratron.checkpoint.peft_export`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paratron.config import ModelConfig
from paratron.layers import ColumnParallelLinear, RowParallelLinear
from paratron.layers.dropout import dropout
from paratron.layers.init import init_shard_, normal_
from paratron.parallel.context import ParallelContext
from paratron.parallel.mappings import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                        reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region)
from paratron.config.model_shape import check_lora
from paratron.parallel.params import ShardSpec, mark

__all__ = ["LoRAAdapter", "apply_lora", "adapter_names", "is_adapter_name", "merge_lora_tensors"]

ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(logical_name: str) -> bool:
    """Whether a logical param name is a LoRA adapter's (``...lora_A.weight`` / ``lora_B``)."""
    return logical_name.endswith(ADAPTER_SUFFIXES)


class LoRAAdapter(nn.Module):
    """The low-rank update of one parallel linear (see the module docstring for the layouts).

    Args:
        base: the :class:`ColumnParallelLinear` or :class:`RowParallelLinear` it adapts (without
            ``gather_output``).
        ctx: the parallel context.
        rank, alpha, p_dropout: ``model.lora_rank``, ``lora_alpha``, ``lora_dropout``.
        seed: the run's seed (draws ``A``).
        rng_tracker: the model's RNG tracker (dropout on a TP-split input draws from its stream).

    Shapes: column base: ``A [r, in]``, ``B [out/tp, r]``; row base: ``A [r, in/tp]``, ``B [out, r]``.
    ``forward(x)`` takes the base's input and returns the delta in the base output's layout
    (``[s, b, out/tp]``, ``[s, b, out]`` or ``[s/tp, b, out]`` under SP).

    Raises:
        ValueError: a base of another type, or with ``gather_output``.
    """

    def __init__(self, base: nn.Module, ctx: ParallelContext, *, rank: int, alpha: float, p_dropout: float,
                 seed: int,
                 rng_tracker=None) -> None:
        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        if not (self.column or isinstance(base, RowParallelLinear)) or getattr(base, "gather_output", False):
            raise ValueError(f"{getattr(base, 'logical_name', type(base).__name__)}: LoRA needs a column-parallel "
                             "(without gather_output) or row-parallel linear")
        self.group, self.sp = ctx.tp, base.sequence_parallel
        self.scaling, self.p_dropout, self.rng_tracker = float(alpha) / rank, float(p_dropout), rng_tracker
        name, w = base.logical_name, base.weight
        tp, tr = ctx.tp.size, ctx.tp.rank
        dev, dtype = w.device, w.dtype
        if self.column:
            a_spec, a_dim = ShardSpec.replicated((rank, base.in_features)), -1
            ws = w.meta.shard
            b_spec, b_dim = ShardSpec((ws.global_shape[0], rank), (ws.offsets[0], 0), (ws.local_shape[0], rank),
                                      ws.stride), 0
        else:
            lo = tr * base.in_per_rank
            a_spec, a_dim = ShardSpec((rank, base.in_features), (0, lo), (rank, base.in_per_rank)), 1
            b_spec, b_dim = ShardSpec.replicated((base.out_features, rank)), -1
        a = torch.empty(a_spec.local_shape, device=dev, dtype=dtype)
        self.lora_A = nn.Parameter(init_shard_(a, normal_(1.0 / math.sqrt(base.in_features)), a_spec, seed,
                                               f"{name}.lora_A.weight"))
        self.lora_B = nn.Parameter(torch.zeros(b_spec.local_shape, device=dev, dtype=dtype))
        # The replicated factor sees sequence-shard partial grads under SP (summed over TP then).
        mark(self.lora_A, f"{name}.lora_A.weight", a_spec, partition_dim=a_dim,
             sequence_parallel=self.sp and self.column and tp > 1)
        mark(self.lora_B, f"{name}.lora_B.weight", b_spec, partition_dim=b_dim,
             sequence_parallel=self.sp and not self.column and tp > 1)

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        # Replicated input (column base without SP): the default stream, the same on every TP rank.
        split = not self.column or self.sp
        return dropout(x, self.p_dropout, self.training, self.rng_tracker, split_over_tp=split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self._dropped(x).matmul(self.lora_A.t()) * self.scaling  # [*, r]
        if self.column:
            # Every rank's B slice reads z: its grad is the sum of their contributions.
            z = gather_from_sequence_parallel_region(z, self.group) if self.sp else copy_to_tp_region(z, self.group)
        else:
            z = reduce_scatter_to_sequence_parallel_region(z, self.group) if self.sp \
                else reduce_from_tp_region(z, self.group)
        return z.matmul(self.lora_B.t())


def _add_adapter(module: nn.Module, inputs: tuple, output):
    """Forward hook of an adapted linear: its output (or the output of ``(output, bias)`` with
    ``skip_bias_add``) plus the adapter's delta."""
    delta = module.lora(inputs[0])
    if isinstance(output, tuple):
        return (output[0] + delta,) + tuple(output[1:])
    return output + delta


def apply_lora(chunks, cfg: ModelConfig, ctx: ParallelContext, *, seed: int, rng_tracker=None) -> list[str]:
    """Freeze every param of ``chunks`` and add an adapter to each target linear.

    A target is a :class:`ColumnParallelLinear` / :class:`RowParallelLinear` whose logical name
    ends in ``.<target>`` for a ``model.lora_targets`` entry (dense and shared-expert MLPs,
    attention); MoE experts are not adapted. Does nothing when ``model.lora_rank`` is 0.

    Returns:
        The logical names of the adapted linears on this rank.

    Raises:
        ConfigError: a rule of :func:`paratron.config.model_shape.check_lora`.
    """
    check_lora(cfg)
    if cfg.lora_rank == 0:
        return []
    targets = tuple(f".{t}" for t in cfg.lora_targets)
    adapted = []
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for module in list(chunk.modules()):
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and \
                    module.logical_name.endswith(targets) and not hasattr(module, "lora"):
                module.lora = LoRAAdapter(module, ctx, rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                                          p_dropout=cfg.lora_dropout, seed=seed, rng_tracker=rng_tracker)
                module.register_forward_hook(_add_adapter)
                adapted.append(module.logical_name)
    return adapted


def adapter_names(names) -> list[str]:
    """The adapter entries of an iterable of logical names, sorted."""
    return sorted(n for n in names if is_adapter_name(n))


def merge_lora_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fold the adapters of full logical tensors into their base weights: ``W += (alpha/r) B A``
    (computed in fp32, stored in ``W``'s dtype); returns the tensors without the adapter entries.

    Args:
        cfg: the model config (``lora_rank``, ``lora_alpha``).
        tensors: logical name -> full tensor, adapters (``<linear>.lora_A.weight`` ``[r, in]``,
            ``<linear>.lora_B.weight`` ``[out, r]``) included.

    Raises:
        KeyError: an adapter without its partner or its base weight.
    """
    out = {k: v for k, v in tensors.items() if not is_adapter_name(k)}
    scale = float(cfg.lora_alpha) / cfg.lora_rank
    for a_name in adapter_names(tensors):
        if not a_name.endswith(".lora_A.weight"):
            continue
        linear = a_name[:-len(".lora_A.weight")]
        b_name, w_name = f"{linear}.lora_B.weight", f"{linear}.weight"
        for n in (b_name, w_name):
            if n not in tensors:
                raise KeyError(f"LoRA merge: {n} is missing (needed to fold {a_name})")
        w = tensors[w_name]
        delta = tensors[b_name].float().matmul(tensors[a_name].float()) * scale
        out[w_name] = (w.float() + delta).to(w.dtype)
    return out
