"""The parallel context: one object holding every process group, rank and size of a layout.

There is no module-level state: layers, optimizers and schedules receive a
:class:`ParallelContext` and ask it for groups (docs/DESIGN.md principle 2). Tests can build a
single-process context (:meth:`ParallelContext.single`) next to a distributed one.

Attributes of a context (each a :class:`~paratron.parallel.comm.Group`):

====================  =======================================================================
``tp``                tensor-parallel group
``cp``                context-parallel group
``dp``                data-parallel group (dense grads reduce over ``dp_cp``: dp x cp)
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

Process groups are made only for the kinds a run communicates on (``build(kinds=...)``; the
training run passes :func:`paratron.training.groups.groups_used` of its config), and only for
groups of more than one rank, once per distinct rank set. The other groups keep their ranks and
this rank's index (the grid is complete, so ``paratron info`` lists every group) but hold no
process group. See docs/ARCHITECTURE.md, "Process groups".
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .comm import CommLedger, Group
from .grid import DEFAULT_ORDER, GROUP_KINDS, RankGrid, build_grid


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
    by name. ``created_groups``: the rank sets of the process groups this rank joined in
    :meth:`build` (the default group not counted).
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
    created_groups: tuple[tuple[int, ...], ...] = ()

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
        kinds: Iterable[str] | None = None,
    ) -> "ParallelContext":
        """Create the process groups of the layout's group ``kinds`` in the current
        ``torch.distributed`` world.

        Args:
            kinds: the group kinds this run communicates on (default: all of
                :data:`GROUP_KINDS`; ``"world"``, the default group, is always there). Only
                their groups of more than one rank get a process group, one per distinct rank
                set (a kind whose groups equal another's shares its process groups; a group of
                every rank is the default group). Every other group is still
                a :class:`Group` with its ranks and this rank's index, but without a process
                group: a collective on it raises :class:`~paratron.parallel.comm.GroupNotCreated`.

        ``new_group`` is collective over the world, so every rank calls it for every group of the
        chosen kinds, in :data:`GROUP_KINDS` order: all ranks must pass the same arguments.
        ``ctx.created_groups`` lists the rank sets of the process groups this rank joined.

        Raises:
            LayoutError: the sizes do not fit the world size (see :func:`build_grid`).
            KeyError: ``kinds`` names something that is not a group kind.
            RuntimeError: ``torch.distributed`` is not initialised.
        """
        if not dist.is_initialized():
            raise RuntimeError("ParallelContext.build needs torch.distributed to be initialised; "
                               "use init_distributed() or ParallelContext.single()")
        world, rank = dist.get_world_size(), dist.get_rank()
        grid = build_grid(world, tp=tp, cp=cp, ep=ep, pp=pp, expert_tp=expert_tp, order=order)
        wanted = _checked_kinds(kinds)
        if device is None:
            device = default_device()
        ledger = CommLedger()
        made = _create_process_groups(grid, wanted)
        groups: dict[str, Group] = {}
        for kind in GROUP_KINDS:
            mine = grid.group_of(kind, rank)
            if mine is None:  # only embedding groups on middle pipeline stages
                groups[kind] = Group(kind, [], -1, None, ledger, device)
            else:
                ok = kind in wanted or len(mine) == 1
                groups[kind] = Group(kind, mine, mine.index(rank), made.get(tuple(mine)) if ok else None,
                                     ledger, device, created=ok, created_kinds=wanted)
        joined = tuple(k for k, pg in made.items() if rank in k and pg is not dist.group.WORLD)
        return cls(grid=grid, rank=rank, device=device, ledger=ledger, created_groups=joined, **groups)

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
        """The layout line: the grid's sizes; the expert grid's (ep, expert_tp, expert_dp) only
        when this context made the expert groups (a MoE run; a dense run's expert_dp, which folds
        CP into DP, would read as a real group)."""
        g = self.grid
        kinds = self.world.created_kinds
        expert = (f" ep={g.ep} expert_tp={g.expert_tp} expert_dp={g.expert_dp}"
                  if not kinds or "expert_dp" in kinds else "")
        return f"world={g.world} tp={g.tp} cp={g.cp} pp={g.pp} dp={g.dp}{expert} order={'-'.join(g.order)}"


def _checked_kinds(kinds: Iterable[str] | None) -> tuple[str, ...]:
    """``kinds`` in :data:`GROUP_KINDS` order (all of them when None), with ``"world"`` (the
    default group, which exists anyway); KeyError on an unknown one."""
    if kinds is None:
        return GROUP_KINDS
    chosen = set(kinds) | {"world"}
    unknown = sorted(chosen - set(GROUP_KINDS))
    if unknown:
        raise KeyError(f"kinds={unknown} are not group kinds; known: {', '.join(GROUP_KINDS)}")
    return tuple(k for k in GROUP_KINDS if k in chosen)


def _create_process_groups(grid: RankGrid, kinds: tuple[str, ...]) -> dict[tuple[int, ...], object]:
    """One process group per distinct rank set of more than one rank among the groups of
    ``kinds``, created by every rank in the same order (``new_group`` is collective over the
    world; a non-member gets ``GroupMember.NON_GROUP_MEMBER`` back). A set of every rank is the
    default group, created by nobody."""
    made: dict[tuple[int, ...], object] = {}
    for kind in kinds:
        for ranks in grid.groups[kind]:
            key = tuple(ranks)
            if len(ranks) > 1 and key not in made:
                made[key] = dist.group.WORLD if len(ranks) == grid.world else dist.new_group(ranks)
    return made


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
