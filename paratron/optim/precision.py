"""The one map from ``train.precision`` to the dtype of params and activations.

fp32 trains in fp32 throughout; bf16 and fp16 keep params and activations in half precision
with fp32 main weights and grads in the optimizer (Micikevicius et al. 2018, section 3.1); fp16
adds dynamic loss scaling (:mod:`paratron.optim.scaler`).
"""

from __future__ import annotations

import torch

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def precision_dtype(precision: str) -> torch.dtype:
    """The param and activation dtype of ``precision`` (``"fp32"``, ``"bf16"`` or ``"fp16"``).

    Raises:
        ValueError: another name, naming the field ``train.precision``.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} must be one of {sorted(PRECISIONS)}")
    return PRECISIONS[precision]
