"""Adapter-only checkpoints of LoRA runs (``model.lora_rank > 0``; :mod:`paratron.models.lora`).

A LoRA run saves only what it trains: the ``model/`` keys of the adapters
(``<linear>.lora_A.weight``, ``lora_B.weight``) and the optimizer state, which holds nothing but
the adapters (frozen params have none); the manifest says ``adapter_only = true``. The frozen
base comes, on every load, from elsewhere:

* ``checkpoint.pretrained_checkpoint``: any paratron checkpoint of the base model (its adapters,
  optimizer state and step are ignored), loaded first;
* or ``checkpoint.load`` itself when it is a full (not adapter-only) checkpoint: a fine-tune
  starting from it (fresh adapters and optimizer, step 0).

Then an adapter-only ``checkpoint.load`` restores the adapters, the optimizer, the scheduler, the
step and the RNG like any resume. Both are read with DCP into any layout, like any checkpoint.
"""

from __future__ import annotations

import dataclasses

from paratron.models.lora import is_adapter_name

from .items import MODEL_PREFIX, StateItems
from .safety import check_same_model

LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


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


def check_same_base(saved: dict, current: dict, where: str) -> None:
    """:func:`~paratron.checkpoint.safety.check_same_model` on everything but the LoRA fields (a
    base checkpoint was saved without adapters, or with others).

    Raises:
        CheckpointError: a weight-relevant base field differs.
    """
    from paratron.config import ModelConfig

    defaults = {k: v for k, v in dataclasses.asdict(ModelConfig()).items() if k in LORA_FIELDS}
    check_same_model({**saved, **defaults}, {**current, **defaults}, where)
