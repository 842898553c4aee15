"""The parallel context: one object holding every process group, rank and size of a layout.

There is no module-level state: layers, optimizers and schedules receive a
:class:`ParallelContext` and ask it for groups (docs/DESIGN.md principle 2). Tests can build a
single-process context (:meth:`ParallelContext.single`) next to a distributed one.

Attributes of a context (each a :class:`~paratron.parallel.comm.Group`):

====================  =======================================================================
``tp``                tensor-parallel group
``cp``                context-parallel group
``dp``                data-parallel group (dense params reduce their grads here)
``pp``                pipeline-parallel group, ordered by stage
``mp``                model-parallel group (tp x pp)
``tp_cp``             tp x cp
``dp_cp``             dp x cp
``tp_dp_cp``          tp x dp x cp (every rank of one pipeline stage)
``world``             all ranks
``embedding``         first and last pipeline stage (tied input/output embeddings); non-members
                      have ``is_member == False``
``position_embedding``first pipeline stage
``expert_tp``         tensor-parallel group of expert layers
``ep``                expert-parallel group
``expert_dp``         data-parallel group of expert params
``expert_tp_ep``      expert-tp x ep
====================  =======================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import CommLedger, Group
from .grid import DEFAULT_ORDER, RankGrid, build_grid

GROUP_KINDS = (
    "tp", "cp", "dp", "pp", "mp", "tp_cp", "dp_cp", "tp_dp_cp", "world", "embedding",
    "position_embedding", "expert_tp", "ep", "expert_dp", "expert_tp_ep",
)


def default_backend() -> str:
    """``"cuda:nccl,cpu:gloo"`` when CUDA is available (NCCL for tensors on the GPU, gloo for
    the host-side traffic that must stay on the CPU: object gathers, checkpoint planning, the
    stop flag), otherwise ``"gloo"``."""
    return "cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo"


@dataclass
class ParallelContext:
    """Groups, ranks and sizes of one N-D layout, for this rank.

    Build it with :meth:`build` (inside an initialised ``torch.distributed`` world) or
    :meth:`single` (one process, no ``torch.distributed``). Sizes: ``tp, cp, ep, pp, dp,
    expert_tp, expert_dp``; ``dp = world / (tp*cp*pp)``. Each group of the table in the module
    docstring is a typed attribute (:data:`GROUP_KINDS` lists them); :meth:`group` looks one up
    by name.
    """

    grid: RankGrid
    rank: int
    device: torch.device
    tp: Group
    cp: Group
    dp: Group
    pp: Group
    mp: Group
    tp_cp: Group
    dp_cp: Group
    tp_dp_cp: Group
    world: Group
    embedding: Group
    position_embedding: Group
    expert_tp: Group
    ep: Group
    expert_dp: Group
    expert_tp_ep: Group
    ledger: CommLedger = field(default_factory=CommLedger)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        pp: int = 1,
        expert_tp: int = 1,
        order: str = DEFAULT_ORDER,
        device: torch.device | None = None,
    ) -> "ParallelContext":
        """Create every group of the layout in the current ``torch.distributed`` world.

        All ranks must call this with the same arguments (``new_group`` is collective).

        Raises:
            LayoutError: the sizes do not fit the world size (see :func:`build_grid`).
            RuntimeError: ``torch.distributed`` is not initialised.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelContext.build needs torch.distributed to be initialised; "
                               "use init_distributed() or ParallelContext.single()")
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = build_grid(world, tp=tp, cp=cp, ep=ep, pp=pp, expert_tp=expert_tp, order=order)
        if device is None:
            device = default_device()
        ledger = CommLedger()
        made: dict[tuple[int, ...], object] = {}
        groups: dict[str, Group] = {}
        for kind in GROUP_KINDS:
            mine = None
            for ranks in grid.groups[kind]:
                key = tuple(ranks)
                if len(ranks) > 1 and key not in made:
                    # Every rank creates every group, in the same order: new_group is collective.
                    made[key] = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
                if rank in ranks:
                    mine = ranks
            if mine is None:  # only embedding groups on middle pipeline stages
                groups[kind] = Group(kind, [], -1, None, ledger, device)
            else:
                groups[kind] = Group(kind, mine, mine.index(rank), made.get(tuple(mine)), ledger, device)
        return cls(grid=grid, rank=rank, device=device, ledger=ledger, **groups)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelContext":
        """A one-process context: every group has size 1, no ``torch.distributed`` needed."""
        grid = build_grid(1)
        ledger, device = CommLedger(), torch.device(device)
        groups = {k: Group(k, [0], 0, None, ledger, device) for k in GROUP_KINDS}
        return cls(grid=grid, rank=0, device=device, ledger=ledger, **groups)

    # ---- group access --------------------------------------------------------------------
    def group(self, kind: str) -> Group:
        """The group named ``kind`` (one of :data:`GROUP_KINDS`).

        Raises:
            KeyError: ``kind`` is not a group kind.
        """
        if kind not in GROUP_KINDS:
            raise KeyError(f"{kind!r} is not a group kind; known: {', '.join(GROUP_KINDS)}")
        return getattr(self, kind)

    @property
    def world_size(self) -> int:
        return self.grid.world

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    def describe(self) -> str:
        g = self.grid
        return (f"world={g.world} tp={g.tp} cp={g.cp} pp={g.pp} dp={g.dp} ep={g.ep} "
                f"expert_tp={g.expert_tp} expert_dp={g.expert_dp} order={'-'.join(g.order)}")


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else ``cpu``."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0, backend: str | None = None) -> None:
    """Initialise ``torch.distributed`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``), unless already done; without torchrun, a world of one
    process (an in-memory store, no port). Backend: :func:`default_backend`."""
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if "nccl" in backend:
        torch.cuda.set_device(default_device())
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
