"""Online change of the pipeline degree: PP=P -> P' at a step boundary, DP x TP x CP fixed, in
memory (docs/elastic.md, "Changing the pipeline degree").

FlexTrain (MLSys'26) keeps DP, TP, the global batch and the microbatches and changes only the
pipeline degree when devices come and go, so the math is unchanged. The world grows or shrinks
by ``world / P`` ranks per stage:

* **Grow** (P' > P) takes processes that the launcher started beside the training world and that
  stand by (``train.elastic_spares``; :func:`paratron.launch.grow.stand_by`). Rank 0 calls as
  many as the new grid needs (a store key per spare); with too few, the request is refused and nothing changes.
* **Shrink** (P' < P): the ranks of the last stages leave; they hand over their state, then
  leave the training loop and their process exits 0.

Every process keeps its coordinates (tp, cp, dp and pp rank, :func:`plan_change`): a survivor's
data shard, RNG streams and stage index stay its own, and rank 0 stays rank 0. At the step
boundary (:func:`paratron.training.regrid_step.change_pipeline` on the training ranks,
:func:`paratron.launch.grow.join` on the spares called in):

1. the default process group is re-made over the launch's store with the new membership, under a
   new generation's key prefix (:func:`remake_world`), and a new
   :class:`~paratron.parallel.context.ParallelContext` is built on it;
2. the union of the old and the new members gets its own gloo group (:class:`UnionGroup`,
   outside the default group, so the leavers can send after the survivors re-made theirs);
3. every member of the new grid builds its chunks, DDP buckets, optimizer, LR schedule, data
   reader and checkpoint manager (a spare: its whole :class:`~paratron.training.trainer.Trainer`;
   a survivor: ``regrid_step.rebuild``, the same builders in the same order, as their collectives
   must match), then :func:`paratron.elastic.relayout.move_state` fills every new tensor by
   rectangles of the full logical tensors over the union (a newcomer holds no old state, a leaver
   no new state);
4. the optimizer's scalar state, the LR schedule, the data position and the other counts of a
   checkpoint's ``extra`` go from rank 0 to the newcomers; survivors keep their RNG streams,
   newcomers derive theirs as a resume into a changed layout does (:func:`paratron.checkpoint.rng.rederive`).

Nothing is written under the checkpoint directory.
"""

from __future__ import annotations

import copy
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from paratron.elastic.relayout import RelayoutRefused, layout_name
from paratron.parallel.context import default_backend
from paratron.parallel.grid import RankGrid, build_grid
from paratron.rules import validate

PREFIX = "paratron-elastic"
"""Key prefix of everything the elastic runs keep in the launch's store."""
POLL_S = 0.2


@dataclass
class ElasticSession:
    """One process's view of the elastic job, across generations of the default process group.

    Attributes:
        store: the launch's store (torchrun's TCP store, or the test harness's file store); it
            outlives every generation's process group.
        slot: this process's rank in the launch (a spare's identity).
        generation: the default group's generation (0: the launch's own group).
        spares: the launch slots standing by, in the order they are called (the same list on
            every training rank).
        timeout: of each re-made process group.
    """

    store: object
    slot: int
    generation: int = 0
    spares: list[int] = field(default_factory=list)
    timeout: timedelta = timedelta(seconds=600)

    def prefixed(self, name: str, generation: int | None = None) -> dist.PrefixStore:
        gen = self.generation if generation is None else generation
        return dist.PrefixStore(f"{PREFIX}/gen{gen}/{name}", self.store)


def start_session(cfg) -> ElasticSession | None:
    """After the launch's process group exists: the session of an elastic run
    (``train.elastic_relayout``), None otherwise. With ``train.elastic_spares = S`` the last S
    launch ranks stand by: the others re-make the default group without them (generation 1)."""
    if not cfg.train.elastic_relayout:
        return None
    world, slot = dist.get_world_size(), dist.get_rank()
    spares = cfg.train.elastic_spares
    session = ElasticSession(dist.distributed_c10d._get_default_store(), slot,
                             spares=list(range(world - spares, world)),
                             timeout=timedelta(seconds=cfg.parallel.timeout_s))
    if spares:
        remake_world(session, 1, slot if slot < world - spares else None, world - spares)
    return session


def remake_world(session: ElasticSession, generation: int, rank: int | None, world: int) -> None:
    """Destroy this process's default group and, unless ``rank`` is None (a leaver, a spare),
    join generation ``generation``'s as ``rank`` of ``world`` (collective over its members)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    session.generation = generation
    if rank is not None:
        dist.init_process_group(default_backend(), store=session.prefixed("world"), rank=rank,
                                world_size=world, timeout=session.timeout)


class UnionGroup:
    """A gloo group of the old and the new members of one change, outside the default group,
    with the part of :class:`~paratron.parallel.comm.Group` that
    :func:`~paratron.elastic.relayout.move_state` uses (``rank``, ``all_gather_object``,
    ``p2p_op``, ``batch_isend_irecv``). Objects travel through the store; tensors on gloo, via
    host copies when they live on an accelerator."""

    def __init__(self, session: ElasticSession, generation: int, rank: int, size: int) -> None:
        self.rank, self.size, self._gathers = rank, size, 0
        self._store = session.prefixed("union", generation)
        self.pg = dist.ProcessGroupGloo(session.prefixed("union/pg", generation), rank, size, session.timeout)

    def all_gather_object(self, obj) -> list:
        n, self._gathers = self._gathers, self._gathers + 1
        self._store.set(f"obj{n}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self._store.get(f"obj{n}/{r}")) for r in range(self.size)]

    def p2p_op(self, kind: str, t: torch.Tensor, peer: int) -> tuple:
        return (kind, t, peer)

    def batch_isend_irecv(self, ops: list) -> list:
        """Post every send and receive, then return their works. The k-th message between two
        ranks carries tag k on both sides: both build their ops from one plan, in one order."""
        count, works = {}, []
        for kind, t, peer in ops:
            tag = count.get((kind, peer), 0)
            count[(kind, peer)] = tag + 1
            host = t if t.device.type == "cpu" else t.detach().cpu()
            if kind == "send":
                works.append(self.pg.send([host.contiguous()], peer, tag))
            else:
                works.append(_Landed(self.pg.recv([host], peer, tag), host, t))
        return works


@dataclass
class _Landed:
    """A receive into a host buffer, copied onto the accelerator once waited for."""

    work: object
    host: torch.Tensor
    into: torch.Tensor

    def wait(self) -> None:
        self.work.wait()
        if self.host is not self.into:
            self.into.copy_(self.host)


@dataclass(frozen=True)
class GridChange:
    """One agreed change of the pipeline degree (:func:`plan_change`).

    Attributes:
        old, new: the rank grids before and after.
        new_rank: per old rank, its rank in the new grid (None: it leaves).
        newcomers: ``(spare slot, new rank)`` of each spare called in.
        layout: the new ``parallel.pipeline_layout`` (None: the default split).
    """

    old: RankGrid
    new: RankGrid
    new_rank: tuple
    newcomers: tuple
    layout: list | None

    @property
    def grow(self) -> bool:
        return self.new.world > self.old.world

    @property
    def union_size(self) -> int:
        return max(self.old.world, self.new.world)

    def union_rank(self, old_rank: int) -> int:
        """Union ranks: the new grid's when growing, the old grid's when shrinking."""
        return self.new_rank[old_rank] if self.grow else old_rank

    def stages(self) -> list[int]:
        """Per union rank, the pipeline stage whose ranks it prefers as sources
        (:func:`~paratron.elastic.relayout.plan_moves`): its new stage, a leaver's old one."""
        if self.grow:
            return [self.new.coords(r)["pp"] for r in range(self.new.world)]
        return [self.old.coords(r)["pp"] if self.new_rank[r] is None else self.new.coords(self.new_rank[r])["pp"]
                for r in range(self.old.world)]


def _same_place(grid: RankGrid, coords: dict) -> int:
    """The rank of ``grid`` with the dense coordinates ``coords`` (tp, cp, dp, pp)."""
    axes = ("tp", "cp", "dp", "pp")
    return next(r for r in range(grid.world) if all(grid.coords(r)[a] == coords[a] for a in axes))


def plan_change(cfg, grid: RankGrid, pipeline: int, layout: list | None, spares: list[int]) -> GridChange:
    """The new grid of ``parallel.pipeline = pipeline`` (DP, TP, CP, EP fixed), checked with every
    config rule at its world size, and where each rank goes: a rank of stage ``s < pipeline``
    keeps its coordinates; stages ``pipeline..`` leave (shrink) or are filled by spares (grow).

    Every ZeRO stage is taken: :func:`~paratron.elastic.relayout.move_state` fills the new DP
    partition of the flat buckets from the old one by rectangles (ZeRO-3: the params as the main
    weights' shards), whatever the pipeline degree; the grads hold nothing at a step boundary.

    Raises:
        RelayoutRefused: the new config breaks a rule (a layout that does not fit the layer
            count, ...), or a grow needs more processes than ``spares`` (launch slots standing
            by) holds.
    """
    p = cfg.parallel
    world = grid.world // grid.pp * pipeline
    trial = copy.deepcopy(cfg)
    trial.parallel.pipeline, trial.parallel.pipeline_layout = pipeline, layout
    what = f"re-layout to parallel.pipeline={pipeline} {layout_name(trial, layout)}"
    trial.train.elastic_spares = 0
    try:
        validate(trial, world)
    except ValueError as e:
        raise RelayoutRefused(f"{what} refused: {e}") from None
    if world - grid.world > len(spares):
        raise RelayoutRefused(f"{what} refused: it needs {world - grid.world} more processes and {len(spares)} stand "
                              "by (no free slot; start the job with more train.elastic_spares)")
    new = build_grid(world, tp=p.tensor, cp=p.context, ep=p.expert, pp=pipeline, expert_tp=p.expert_tensor,
                     order=p.order)
    new_rank = tuple(_same_place(new, c) if c["pp"] < pipeline else None
                     for c in (grid.coords(r) for r in range(grid.world)))
    fresh = sorted(set(range(world)) - set(new_rank))
    return GridChange(grid, new, new_rank, tuple(zip(spares, fresh)), layout)


def call_key(slot: int) -> str:
    """The store key a spare waits on: rank 0 sets it to the spare's call (or ``"exit"``)."""
    return f"{PREFIX}/spare/{slot}"


def wait_for_call(session: ElasticSession) -> dict | None:
    """A spare: block until rank 0 calls it in (the call of ``regrid_step.change_pipeline``), or None when
    the job ended without needing it."""
    key = call_key(session.slot)
    while not session.store.check([key]):
        time.sleep(POLL_S)
    call = pickle.loads(session.store.get(key))
    return None if call == "exit" else call


def release_spares(session: ElasticSession | None, rank: int) -> None:
    """Rank 0 at the end of the job: the spares never called in exit 0."""
    if session is not None and rank == 0:
        for slot in session.spares:
            session.store.set(call_key(slot), pickle.dumps("exit"))
        session.spares = []


def mover(union: UnionGroup, stages: list[int]) -> SimpleNamespace:
    """What :func:`~paratron.elastic.relayout.move_state` asks of a context, over the union
    (``stages``: :meth:`GridChange.stages`)."""
    return SimpleNamespace(world=union, pp=SimpleNamespace(rank=stages[union.rank]))
