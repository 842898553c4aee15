"""Named ranges for ``torch.profiler``: paratron's actions and collectives as ``record_function``.

:func:`labelled` is the one way paratron code opens a profiler range. It checks whether a
profiler is collecting (``torch._C._autograd._profiler_enabled()``, one C call) and otherwise
returns a no-op context, so that steps outside ``train.profile_steps`` create no
``RecordFunction`` at all (they pay for the check only).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

_OFF = nullcontext()  # stateless and reusable: the shared "no range" context


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler``/``torch.autograd.profiler`` session is collecting now."""
    return bool(torch._C._autograd._profiler_enabled())


def labelled(name: str):
    """``torch.profiler.record_function(name)`` while a profiler collects, else a no-op context."""
    if not profiler_enabled():
        return _OFF
    return torch.profiler.record_function(name)
