"""Keep freed host memory in the process, so a CPU training step stops paying page faults.

A CPU step frees and re-allocates the same large buffers every iteration (the ``[tokens, V]``
logits and their grad, activations saved for backward, grad buckets). Under glibc's defaults
each of them goes back to the kernel when freed: blocks above the mmap threshold are
``munmap``-ed, and a free that leaves more than the trim threshold at the top of the heap shrinks
it. The next step then touches fresh pages, and every 4 KiB page is one minor fault with the
kernel zeroing it: on the main job's layout-(1) step, with another process sharing the cores,
that was 2-9 thousand faults and up to 15 ms of system time per step (``benchmarks/README.md``,
"A fourth host"; alone on an idle host, fewer).

:func:`keep_freed_host_memory` raises the mmap threshold to glibc's largest (32 MiB on a 64-bit
build; setting it also turns off the dynamic threshold) and turns trimming off, so freed blocks
stay mapped and the next step reuses them. The cost is that the process keeps its peak heap
(which a training step reaches again every iteration anyway). Blocks above 32 MiB are still
mapped and unmapped per allocation. CUDA memory is untouched (it has its own caching allocator).
The settings are process-wide and last for the process's life (``paratron train`` owns its
process; an in-process caller such as a test keeps them too). PyTorch's CPU tuning guide makes
the same point by recommending jemalloc or tcmalloc; this needs no preloaded library.
"""

from __future__ import annotations

import ctypes
import sys

from paratron.parallel.context import default_device

# mallopt's parameter numbers, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
LARGEST_MMAP_THRESHOLD = 32 << 20
"""glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit builds, bytes: mallopt refuses more."""


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed heap memory mapped for reuse (see the module docstring).

    Returns True when both settings were applied; False where the C library is not glibc (or
    not Linux), where nothing is changed. Applies to allocations made after the call. Raises
    nothing.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; a trim threshold of -1 (as an unsigned size) means never trim.
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, -1))


def keep_host_memory_if_cpu(enabled: bool) -> bool:
    """``train.keep_host_memory``: :func:`keep_freed_host_memory` when ``enabled`` and this rank
    computes on the CPU (:func:`default_device`); call it before the model is built. Returns
    whether the settings were applied."""
    return enabled and default_device().type == "cpu" and keep_freed_host_memory()
