"""Re-make the process group of a running job with a new membership (same processes where they survive).

An elastic job keeps one key-value store alive for its whole life: a :class:`torch.distributed.TCPStore`
served by the launcher (paratron's elastic launcher, :mod:`paratron.launch.elastic`), not by
rank 0, so that it outlives any rank. Each membership of the job is a *generation* ``g`` = 0, 1, 2,
...; the process group of generation ``g`` rendezvouses over ``PrefixStore("paratron/gen/g",
store)``, so the keys of a dead generation (half-done rendezvous, counters of a failed
collective) never mix with the next one.

Public API:

* :func:`connect_store`: a client of the job's store (``MASTER_ADDR``, ``MASTER_PORT``).
* :func:`remake_world`: abort every process group of this process (the default group and the
  :class:`~paratron.parallel.context.ParallelContext`'s subgroups: torch keeps them all in one
  registry), then join generation ``g``'s default group as ``rank`` of ``world_size``. Called by
  every member of the new generation (survivors and newcomers) with the same ``generation``.
* :func:`rebuild_context`: a new :class:`ParallelContext` over the re-made world, with the sizes
  of an old context, optionally another pipeline degree (the data-parallel degree follows from
  the world size). It creates the subgroups, so it is collective over the new world.

Old handles must go: a process group object still referenced after the abort (by an old context's
groups, say) makes the next generation's gloo rendezvous fail ("Connection refused" towards a
peer, then a store timeout; seen with torch 2.13), so :func:`remake_world` first drops the
handles of the contexts it is given (:func:`release_context`) and collects the garbage.

Why abort and not ``destroy_process_group``: after a peer's death a survivor may still hold a
process group whose other members wait in a collective; ``ProcessGroupGloo.abort`` closes its
connections at once, so a peer blocked on this rank fails too instead of waiting for the
timeout (the failure cascades to every rank of a broken group). Objects that still reference
an old group (an old context, its model and optimizer) must not use it again: every collective on
an aborted group raises.

Errors: a rendezvous that does not complete within ``timeout_s`` raises the store's
``DistStoreError`` (a member of the new generation never came); :func:`connect_store` raises
``ValueError`` when ``MASTER_ADDR``/``MASTER_PORT`` are not set.

See docs/elastic.md, "Re-making the process group" and "Replacing a dead rank".
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from paratron.parallel.context import ParallelContext, default_backend
from paratron.parallel.grid import GROUP_KINDS

GENERATION_PREFIX = "paratron/gen/"
"""Generation ``g``'s rendezvous keys live under ``GENERATION_PREFIX + str(g) + "/"``."""


def connect_store(timeout_s: float, addr: str | None = None, port: int | None = None) -> dist.TCPStore:
    """A client of the job's store at ``addr:port`` (default: ``MASTER_ADDR``, ``MASTER_PORT``).

    Raises:
        ValueError: no address or port given and the environment has none.
    """
    addr = addr or os.environ.get("MASTER_ADDR")
    port = port or int(os.environ.get("MASTER_PORT") or 0)
    if not addr or not port:
        raise ValueError("connect_store: MASTER_ADDR and MASTER_PORT must be set (the elastic launcher "
                         "serves the job's store there)")
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def generation_store(store: dist.Store, generation: int) -> dist.PrefixStore:
    """The view of ``store`` that generation ``generation``'s rendezvous uses."""
    return dist.PrefixStore(f"{GENERATION_PREFIX}{int(generation)}/", store)


def abort_world() -> None:
    """Abort every process group of this process and forget them (no-op when none exists).

    Safe after a failed collective: it does not wait for the peers (see the module docstring)."""
    if dist.is_initialized():
        c10d._abort_process_group()


def release_context(ctx: ParallelContext) -> None:
    """Let go of every process group ``ctx`` holds: each group's handle is dropped and marked not
    created, so a later collective on it raises :class:`~paratron.parallel.comm.GroupNotCreated`
    (naming the group) instead of reaching an aborted process group. The ranks, sizes and grid
    stay, for code that only reads them."""
    for kind in GROUP_KINDS:
        group = ctx.group(kind)
        group.pg, group.created = None, False


def remake_world(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float,
                 backend: str | None = None, release: Iterable[ParallelContext] = ()) -> None:
    """Leave the current process groups and join generation ``generation``'s world as ``rank``.

    Args:
        store: the job's store (:func:`connect_store`), shared by every generation.
        generation: the new membership's number; every member passes the same one, and a
            generation is joined once (its keys are not reused).
        rank, world_size: this process's place in the new world (a survivor may keep its rank or
            get another one; a replacement takes the dead rank's).
        timeout_s: the rendezvous timeout and the default timeout of every collective of the new
            world (``init_process_group(timeout=...)``).
        backend: default :func:`~paratron.parallel.context.default_backend`.
        release: the contexts of the old world that live on (with the model and optimizer built
            on them); their groups are released first (:func:`release_context`).

    Raises:
        torch.distributed.DistStoreError: the rendezvous did not complete in ``timeout_s``.
        ValueError: ``rank`` not in ``[0, world_size)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"remake_world: rank {rank} is not in [0, {world_size})")
    for ctx in release:
        release_context(ctx)
    gc.collect()  # handles held in reference cycles (work objects, closures) go too
    abort_world()
    dist.init_process_group(backend or default_backend(), store=generation_store(store, generation),
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))


def rebuild_context(old: ParallelContext, pp: int | None = None) -> ParallelContext:
    """A :class:`ParallelContext` over the current (re-made) world with ``old``'s tensor, context,
    expert and expert-tensor sizes, its group order and the group kinds it created, and pipeline
    degree ``pp`` (default: ``old``'s). ``dp`` is ``world / (tp * cp * pp)``. Collective over the
    new world: every member calls it with the same sizes.

    Raises:
        LayoutError: the sizes do not fit the new world size.
    """
    g = old.grid
    kinds = old.world.created_kinds or None
    return ParallelContext.build(tp=g.tp, cp=g.cp, ep=g.ep, pp=g.pp if pp is None else pp,
                                 expert_tp=g.expert_tp, order="-".join(g.order), device=old.device,
                                 kinds=kinds)
