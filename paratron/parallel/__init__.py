"""Process-group mesh, collectives with a ledger, and the harness-free parts of parallelism."""

from .comm import CommLedger, Group
from .context import ParallelContext, default_backend, default_device, init_distributed
from .grid import DEFAULT_ORDER, LayoutError, RankGrid, build_grid

__all__ = ["CommLedger", "Group", "ParallelContext", "default_backend", "default_device",
           "init_distributed", "DEFAULT_ORDER", "LayoutError", "RankGrid", "build_grid"]
