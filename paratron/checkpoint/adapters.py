"""Adapter-only checkpoints of LoRA runs (``model.lora_rank > 0``; :mod:`paratron.models.lora`).

A LoRA run saves only what it trains: the ``model/`` keys of the adapters
(``<linear>.lora_A.weight``, ``lora_B.weight``) and the optimizer state, which holds nothing but
the adapters (frozen params have none); the manifest says ``adapter_only = true``. The frozen
base comes, on every load, from elsewhere:

* ``checkpoint.pretrained_checkpoint``: any paratron checkpoint of the base model (its adapters,
  optimizer state and step are ignored), loaded first;
* or ``checkpoint.load_hf`` (``paratron train --from-hf DIR``), loaded first too;
* or ``checkpoint.load`` itself when it is a full (not adapter-only) checkpoint: a fine-tune
  starting from it (fresh adapters and optimizer, step 0).

Then an adapter-only ``checkpoint.load`` restores the adapters, the optimizer, the scheduler, the
step and the RNG like any resume. Both are read with DCP into any layout, like any checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from paratron.models.lora import adapter_names, is_adapter_name, merge_lora_tensors

from .hf import hf_to_paratron
from .io import holds_no_checkpoint, load_model_full, read_manifest, resolve
from .items import MODEL_PREFIX, CheckpointError, StateItems


def lora_on(config) -> bool:
    """Whether the run trains LoRA adapters (``model.lora_rank > 0``)."""
    return int(getattr(config.model, "lora_rank", 0) or 0) > 0


def _model_key_is_adapter(key: str) -> bool:
    return key.startswith(MODEL_PREFIX) and is_adapter_name(key[len(MODEL_PREFIX):])


def only_adapters(items: StateItems) -> StateItems:
    """The items an adapter-only checkpoint holds: adapter ``model/`` keys and every other
    (optimizer) key."""
    return {k: v for k, v in items.items() if not k.startswith(MODEL_PREFIX) or _model_key_is_adapter(k)}


def base_weights(items: StateItems) -> StateItems:
    """The frozen base's ``model/`` items (no adapter, no optimizer state)."""
    return {k: v for k, v in items.items() if k.startswith(MODEL_PREFIX) and not _model_key_is_adapter(k)}


def base_tensors(config) -> dict[str, torch.Tensor] | None:
    """The full base tensors a LoRA run's config names: ``checkpoint.pretrained_checkpoint``,
    else ``checkpoint.load_hf`` (a Hugging Face folder), else ``checkpoint.load`` when that holds a
    full (not adapter-only) checkpoint; None when it names none."""
    c = config.checkpoint
    if c.pretrained_checkpoint:
        return load_model_full(resolve(c.pretrained_checkpoint))[1]
    if getattr(c, "load_hf", None):
        return hf_to_paratron(c.load_hf)[1]
    if c.load and not holds_no_checkpoint(c.load):
        directory = resolve(c.load)
        if not read_manifest(directory).get("adapter_only"):
            return load_model_full(directory)[1]
    return None


def with_base(config, tensors: dict[str, torch.Tensor], base: str | Path | None = None,
              where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Full tensors of an adapter-only checkpoint completed with its base's (the checkpoint
    ``base``, else :func:`base_tensors` of its config); other checkpoints are returned as they are.

    Raises:
        CheckpointError: adapters without a base to put them on.
    """
    if base is not None:
        return {**load_model_full(resolve(base))[1], **tensors}
    if not (adapter_names(tensors) and all(is_adapter_name(n) for n in tensors)):
        return tensors
    found = base_tensors(config)
    if found is None:
        raise CheckpointError(f"{where} holds only LoRA adapters and its config names no base "
                              "(checkpoint.pretrained_checkpoint): give the base checkpoint")
    return {**found, **tensors}


def merged(config, tensors: dict[str, torch.Tensor], where: str = "checkpoint"):
    """``(model config, full tensors)`` to export: a LoRA checkpoint's adapters folded into its
    base (:func:`with_base`; ``model.lora_rank`` then 0), any other as it is."""
    tensors = with_base(config, tensors, where=where)
    if not adapter_names(tensors):
        return config.model, tensors
    return dataclasses.replace(config.model, lora_rank=0), merge_lora_tensors(config.model, tensors)
