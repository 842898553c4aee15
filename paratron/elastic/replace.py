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
The trainer's side (what the survivors and the replacement do with their trainers) is
:mod:`paratron.training.replace_step`.

* **Survivors** (``replace_step.rejoin``): a failed collective (or an aborted vote) ends the step; the
  rank aborts its process groups at once (so that peers blocked on it fail too: the failure
  cascades, docs/elastic.md "Re-making the process group"), waits for the failure record, joins
  generation ``g + 1`` with the same rank, rebuilds its trainer parts on the new context
  (:func:`paratron.training.regrid_step.rebuild`, the builders ``Trainer.__init__`` calls, in its
  order), fills them from its old objects (a local copy, :func:`~paratron.elastic.relayout.move_state`),
  and hands its counts to the replacement.
* **The replacement** (``replace_step.take_over``): builds its whole ``Trainer`` in generation ``g + 1``,
  receives params and optimizer state from its DP replica (``move_state`` prefers a rank of the
  same stage), and the optimizer's scalar state, LR schedule, data position, step counts and RNG
  streams (those of its DP replica: the streams are seeded per stage, docs/checkpoints.md) from
  a survivor.

Errors: :class:`RankLost` when a vote ends in ``abort``; :class:`ReplaceFailed` when the
survivors do not agree on the step to go on from.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratron.elastic.regroup import connect_store, remake_world

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


def ready_key(pid: int) -> str:
    """Set by a rank process once its trainer is built (or, for a replacement, once it holds the
    dead rank's state): from then on a death of a peer ends one of its steps, so it waits to
    regroup. A death before every process of the job has set it ends no step (the others may be
    blocked in the first rendezvous), so the launcher restarts every rank instead."""
    return f"{KEYS}ready/{int(pid)}"


TRAINED_KEY = f"{KEYS}trained"
"""Set by a rank whose training loop has ended (its last step, and save, done): a death from then
on ends no step, so nothing is replaced or restarted; the other ranks finish the job."""


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

    def mark_ready(self) -> None:
        """This process holds its trainer's whole state (:func:`ready_key`)."""
        self.store.set(ready_key(os.getpid()), "1")

    def mark_trained(self) -> None:
        """This rank's training loop has ended (:data:`TRAINED_KEY`)."""
        self.store.set(TRAINED_KEY, "1")

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
