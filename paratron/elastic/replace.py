"""Replacing a dead rank in place: the ranks' side (docs/elastic.md, "Replacing a dead rank").

Under ``train.replace_dead_ranks`` paratron's launcher (:mod:`paratron.launch.elastic`) starts
the ranks itself and serves their store. Each membership is a generation ``g`` (its default group
rendezvouses under :func:`~paratron.elastic.regroup.generation_store`). When a rank of ``g`` dies,
the launcher writes the failure record ``failed/g`` (:func:`failed_key`) and, when a DP replica
holds the dead rank's whole state (:func:`plan_for_death`), starts a replacement with the same
rank in generation ``g + 1``.

* **Commit point.** Every step, right after the optimizer's one world all-reduce (sum of squares
  of the grads and the non-finite flag) and before any update, each rank votes in the store
  (:meth:`Membership.vote`): the rank whose vote makes the count the world size writes
  ``commit``, a rank that sees the failure record first writes ``abort``, with one atomic
  compare-and-set, so every survivor reads the same decision. ``commit``: every survivor applies
  step ``k`` (the dead rank voted, so its replica holds the state the dead rank would have had);
  ``abort``: none does, and step ``k`` is redone. After the decision the rest of the step is
  local (``parallel.zero = 0``: the update and the copy into the params).
* **Survivors** (:func:`rejoin`): a failed collective (or an aborted vote) ends the step; the
  rank aborts its process groups at once (so that peers blocked on it fail too: the failure
  cascades, docs/elastic.md "Re-making the process group"), waits for the failure record, joins
  generation ``g + 1`` with the same rank, rebuilds its trainer parts on the new context
  (:func:`paratron.training.regrid_step.rebuild`, the builders ``Trainer.__init__`` calls, in its
  order), fills them from its old objects (a local copy, :func:`~paratron.elastic.relayout.move_state`),
  and hands its counts to the replacement.
* **The replacement** (:func:`take_over`): builds its whole ``Trainer`` in generation ``g + 1``,
  receives params and optimizer state from its DP replica (``move_state`` prefers a rank of the
  same stage), and the optimizer's scalar state, LR schedule, data position, step counts and RNG
  streams (those of its DP replica: the streams are seeded per stage, docs/checkpoints.md) from
  a survivor.

Errors: :class:`RankLost` when a vote ends in ``abort``; :class:`ReplaceFailed` when the
survivors do not agree on the step to go on from.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratron.checkpoint import rng
from paratron.elastic.regroup import abort_world, connect_store, release_context, remake_world
from paratron.elastic.relayout import move_state, state_items
from paratron.training.groups import context_for
from paratron.training.regrid_step import carried, rebuild
from paratron.training.step_log import log

ELASTIC_ENV = "PARATRON_ELASTIC"
"""Set (to "1") by the elastic launcher for the ranks it starts: join through its store."""
GENERATION_ENV = "PARATRON_GENERATION"
"""The generation a rank process joins (0 for the launch; a replacement's is the next one)."""
REPLACES_ENV = "PARATRON_REPLACES"
"""Set for a replacement process: the rank it takes over (its state comes from a DP replica)."""
KEYS = "paratron/elastic/"
POLL_S = 0.002


class RankLost(RuntimeError):
    """A step's vote ended in ``abort``: a rank died before it voted; no survivor applied the step."""


class ReplaceFailed(RuntimeError):
    """The survivors of a rank's death hold different steps (they cannot go on together)."""


def failed_key(generation: int) -> str:
    """The launcher's failure record of ``generation`` (JSON, :func:`failure_record`)."""
    return f"{KEYS}failed/{int(generation)}"


def lost_key(generation: int, rank: int) -> str:
    """Set by a survivor of ``generation`` whose step a rank's death ended (it waits to regroup):
    the launcher starts the replacement once one is set (a death after the job's last
    collective ends no step, and needs none)."""
    return f"{KEYS}lost/{int(generation)}/{int(rank)}"


def failure_record(mode: str, dead: int, pid: int, generation: int, reason: str) -> bytes:
    """What the launcher writes under :func:`failed_key`: ``mode`` "replace" or "restart", the dead
    rank and its pid, the next ``generation``, the ``reason`` of the decision, and ``detected``
    (Unix time, s) when the launcher saw the death."""
    return json.dumps({"mode": mode, "dead": dead, "pid": pid, "generation": generation, "reason": reason,
                       "detected": time.time()}).encode()


def plan_for_death(cfg, world: int) -> tuple[str, str]:
    """``("replace", why)`` when a DP replica holds the whole state of every rank (DP >= 2 and
    ``parallel.zero = 0``: params and optimizer state are replicated over DP), else
    ``("restart", why)``: the job restarts from the last checkpoint."""
    p = cfg.parallel
    dp = world // (p.tensor * p.context * p.pipeline)
    if dp < 2:
        return "restart", f"no DP replica holds its state (data-parallel degree {dp})"
    if p.zero > 0:
        return "restart", (f"its optimizer shard has no copy (parallel.zero={p.zero} shards the optimizer "
                           "state over DP)")
    return "replace", f"a DP replica holds its state (data-parallel degree {dp}, parallel.zero=0)"


@dataclass
class Membership:
    """This process's place in an elastic launch: the launcher's store, its rank, the world size
    and the generation of its current default group."""

    store: dist.Store
    rank: int
    world: int
    generation: int
    timeout_s: float
    replaces: bool = False

    def vote(self, iteration: int) -> None:
        """The commit point of step ``iteration`` (module docstring); returns on ``commit``.

        Raises:
            RankLost: the decision is ``abort`` (a rank died before voting).
        """
        base = f"{KEYS}commit/{self.generation}/{iteration}/"
        if self.store.add(base + "votes", 1) == self.world:
            self.store.compare_set(base + "decision", "", "commit")
        failed = failed_key(self.generation)
        while True:
            if self.store.check([base + "decision"]):
                decision = self.store.get(base + "decision")
            elif self.store.check([failed]):
                decision = self.store.compare_set(base + "decision", "", "abort")
            else:
                time.sleep(POLL_S)
                continue
            if decision == b"commit":
                return
            raise RankLost(f"step {iteration} not applied: a rank of generation {self.generation} died before "
                           "the commit point")

    def failure(self, wait_s: float) -> dict | None:
        """The failure record of this generation, waiting up to ``wait_s`` for the launcher to
        write it; None if it does not (the error was not a rank's death)."""
        self.store.set(lost_key(self.generation, self.rank), "1")
        key, deadline = failed_key(self.generation), time.monotonic() + wait_s
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return json.loads(self.store.get(key))


def join_world(cfg) -> Membership | None:
    """Under the elastic launcher (:data:`ELASTIC_ENV`): join this process's generation's default
    group through the launcher's store and return the :class:`Membership`; None otherwise."""
    if not os.environ.get(ELASTIC_ENV):
        return None
    timeout = cfg.parallel.timeout_s
    m = Membership(connect_store(timeout), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                   int(os.environ.get(GENERATION_ENV) or 0), timeout, replaces=bool(os.environ.get(REPLACES_ENV)))
    remake_world(m.store, m.generation, m.rank, m.world, timeout)
    return m


class _VotingWorld:
    """``ctx.world`` whose ``all_reduce`` is followed by the vote (:func:`commit_point`)."""

    def __init__(self, world, vote) -> None:
        self._world, self._vote, self.votes = world, vote, 0

    def all_reduce(self, t: torch.Tensor, *args, **kwargs):
        out = self._world.all_reduce(t, *args, **kwargs)
        if t.device.type != "cpu":
            t.cpu()  # the reduced values are here before this rank votes
        self.votes += 1
        self._vote()
        return out

    def __getattr__(self, name):
        return getattr(self._world, name)


class _VotingContext:
    def __init__(self, ctx, world: _VotingWorld) -> None:
        self._ctx, self.world = ctx, world

    def __getattr__(self, name):
        return getattr(self._ctx, name)


@contextmanager
def commit_point(optimizer, membership: Membership | None, iteration: int):
    """Around ``optimizer.step``: its one world all-reduce (the grads' sum of squares and the
    non-finite flag, the last collective before the update) is followed by
    :meth:`Membership.vote` of ``iteration``. No-op without a membership.

    Raises:
        RankLost: the vote ended in ``abort``.
        RuntimeError: the step made no world all-reduce (the vote would be skipped)."""
    if membership is None:
        yield
        return
    ctx = optimizer.ctx
    world = _VotingWorld(ctx.world, lambda: membership.vote(iteration))
    optimizer.ctx = _VotingContext(ctx, world)
    try:
        yield
    finally:
        optimizer.ctx = ctx
    if world.votes != 1:
        raise RuntimeError(f"commit point: optimizer.step made {world.votes} world all-reduces, not 1")


def _handover(trainer) -> dict:
    """What a survivor hands to the replacement (and checks against the other survivors)."""
    return {**carried(trainer), "streams": rng.capture(trainer.chunks), "coords": trainer.ctx.grid.coords(trainer.ctx.rank),
            "boundary_pending": trainer.boundary_pending}


def _same_place(a: dict, b: dict) -> bool:
    """Same stage and tensor/context coordinates: a DP replica (its RNG streams are the dead rank's)."""
    return all(a[k] == b[k] for k in ("tp", "cp", "pp", "expert_tp"))


def pending_boundary(handovers: list) -> bool:
    """Whether every rank redoes the last step's boundary: when any survivor has it pending. A
    world collective of the boundary (the stop agreement) may complete on some ranks and not on
    others; redoing it everywhere is harmless (the same agreement, a save of the same step)."""
    return any(h["boundary_pending"] for h in handovers if h is not None)


def rejoin(trainer, record: dict) -> int:
    """A survivor: join generation ``record["generation"]`` with the same rank, rebuild, keep its
    state; returns the elements received (0: everything was local). Collective over the new world.

    Raises:
        ReplaceFailed: the survivors hold different steps."""
    m, old_ctx = trainer.membership, trainer.ctx
    if trainer.ckpt is not None:
        try:
            trainer.ckpt.wait()  # a save in flight used the old groups; it may have failed with them
        except Exception as e:  # noqa: BLE001 - the last complete checkpoint stays the fallback
            log(old_ctx, f"warning: checkpoint save in flight at the rank's death failed: {e}")
    old, handover = state_items(trainer.chunks, trainer.optimizer), _handover(trainer)
    m.generation = record["generation"]
    remake_world(m.store, m.generation, m.rank, m.world, m.timeout_s, release=[old_ctx])
    rebuild(trainer, context_for(trainer.cfg))
    moved = move_state(trainer.ctx, old, state_items(trainer.chunks, trainer.optimizer))
    got = trainer.ctx.world.all_gather_object(handover)
    steps = {r: h["progress"]["iteration"] for r, h in enumerate(got) if h is not None}
    if len(set(steps.values())) != 1:
        raise ReplaceFailed(f"the survivors hold different steps after rank {record['dead']} died: {steps}")
    trainer.boundary_pending = pending_boundary(got)
    trainer.adopt(handover["scalar"], handover["scheduler"], handover["streams"])
    flight = trainer.ctx.ledger.flight
    if flight is not None:  # the replacement's recorder is attached when its loop starts, after these moves
        flight.restart_counts()
    return moved


def take_over(trainer) -> int:
    """The replacement, its ``Trainer`` built in the new generation: receive the dead rank's state
    from its DP replica and the counts from a survivor; returns the elements received."""
    ctx, m = trainer.ctx, trainer.membership
    trainer.recovered = json.loads(m.store.get(failed_key(m.generation - 1)))
    moved = move_state(ctx, {}, state_items(trainer.chunks, trainer.optimizer))
    got = ctx.world.all_gather_object(None)
    me = ctx.grid.coords(ctx.rank)
    src = next(h for h in got if h is not None and _same_place(h["coords"], me))
    trainer.restore_progress(src["progress"])
    trainer.microbatch_time, trainer.measure_step = src["microbatch_time"]
    trainer.state.dp_microbatches = src["dp_microbatches"]
    trainer.boundary_pending = pending_boundary(got)
    trainer.adopt(src["scalar"], src["scheduler"], src["streams"])
    return moved


def let_go(trainer, exc: BaseException) -> None:
    """Drop every reference to the old process groups: gloo closes a group's connections (which
    wakes the peers blocked on them) only when nothing holds it any more; seen with torch 2.13,
    where a survivor waited on this rank's DP all-reduce until the timeout while the failed
    step's frames (in ``exc``'s traceback) and the DDP buckets' reductions in flight held it."""
    traceback.clear_frames(exc.__traceback__)
    release_context(trainer.ctx)
    for states in getattr(trainer.ddp, "_states", []):  # each bucket's reduction in flight
        for st in states:
            st.handle = None
    gc.collect()


def recover(trainer, exc: BaseException) -> bool:
    """After ``exc`` ended a step: True when it was a rank's death and this survivor went on in
    the next generation (the step is redone); False when ``exc`` is to be raised (no membership,
    or no failure record came within the process-group timeout)."""
    m = trainer.membership
    if m is None:
        return False
    let_go(trainer, exc)
    abort_world()  # peers blocked on this rank fail now instead of at their timeout
    record = m.failure(m.timeout_s)
    if record is None:
        return False
    if record["mode"] != "replace":  # the launcher ends every rank and restarts from the checkpoint
        log(trainer.ctx, f"rank {record['dead']} died: {record['reason']}; the launcher restarts the job")
        time.sleep(m.timeout_s)
        return False
    t0 = time.perf_counter()
    moved = rejoin(trainer, record)
    trainer.recovered = dict(record, rejoin_s=time.perf_counter() - t0)
    log(trainer.ctx, f"rank {record['dead']} died ({record['reason']}): replaced in place, generation "
                     f"{m.generation}, going on from iteration {trainer.state.iteration} "
                     f"({time.perf_counter() - t0:.2f} s to regroup; {moved:,} elements received here)")
    return True
