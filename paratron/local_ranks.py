"""Multi-rank test harness: run one function on N ranks under a hard timeout.

Ranks are forked from the calling process (which has already imported torch, so a rank starts in
milliseconds instead of the ~1.7 s a fresh interpreter costs), join a gloo world through a file
store (no port races), run with one thread each, and send back a result or a traceback.

* A failure on any rank raises :class:`RankFailure` carrying that rank's traceback.
* A hang raises :class:`RankTimeout` naming the ranks that did not finish; all ranks are killed.
* A failed rendezvous (before any rank runs the function: every rank passes a barrier first) is
  repeated from a fresh store, up to ``RENDEZVOUS_ATTEMPTS`` launches.

The parent must not have used more than one intra-op thread before forking (the test suite's
``conftest.py`` sets ``torch.set_num_threads(1)``): OpenMP thread pools do not survive ``fork``.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from paratron.device_audit import audit_device


# gloo's full-mesh connect has been seen to fail ("Connection closed by peer") at load average
# 20-40 on 2 cores, before any test code runs; the launch is then repeated from a fresh store.
RENDEZVOUS_ATTEMPTS = 3


class RankFailure(AssertionError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(AssertionError):
    """Some ranks did not finish within the timeout; the message names them."""


def _child(fn, rank, world, store_path, args, kwargs, conn, pg_timeout_s, pg_backend):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    try:
        store = dist.FileStore(store_path, world)
        if "auditgpu" in pg_backend:
            audit_device()  # the device type must exist before a backend is mapped to it
        try:
            dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=pg_timeout_s))
            # No rank starts fn before every rank has joined, so a failed rendezvous leaves
            # nothing half-done and the launch can be repeated.
            dist.barrier()
        except Exception:  # noqa: BLE001 - reported to the parent, which may relaunch
            conn.send(("rendezvous", traceback.format_exc()))
            return
        result = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        conn.send(("err", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        finally:
            conn.close()
            # Skip interpreter teardown: a rank has been seen to abort there after its work was done.
            os._exit(0)


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout: float = 120.0,
              pg_backend: str = "gloo", start_method: str = "fork", **kwargs) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results by rank.

    ``pg_backend`` is the ``init_process_group`` backend string; the device audit
    (:mod:`paratron.device_audit`) passes ``"cpu:gloo,auditgpu:gloo"``. ``start_method``
    ``"forkserver"`` forks the ranks from a fresh interpreter instead of this process: needed
    where this process's autograd engine must not be inherited (its device threads do not
    survive a fork; the device audit's stand-in accelerator needs them).

    Inside ``fn``, ``torch.distributed`` is initialised and ``RANK``/``WORLD_SIZE`` are set.
    Results travel through ``torch.save``, so tensors and plain Python values are fine.

    Raises:
        RankFailure: a rank raised (the first failing rank's traceback is in the message).
        RankTimeout: not every rank reported within ``timeout`` seconds.
    """
    import torch

    results: dict[int, tuple[str, Any]] = {}
    for _ in range(RENDEZVOUS_ATTEMPTS):
        results = _launch(fn, world_size, args, kwargs, timeout, pg_backend, start_method)
        if not any(kind == "rendezvous" for kind, _ in results.values()):
            break
    else:
        results = {r: ("err", msg) if kind == "rendezvous" else (kind, msg)
                   for r, (kind, msg) in results.items()}

    failed = sorted(r for r, (k, _) in results.items() if k == "err")
    if failed:
        r = failed[0]
        raise RankFailure(f"rank {r} of {world_size} failed (failed ranks: {failed}):\n{results[r][1]}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout:.0f} s "
                          "(a hang: a collective or p2p that some rank never joined)")
    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]


def _launch(fn, world_size, args, kwargs, timeout, pg_backend, start_method) -> dict[int, tuple[str, Any]]:
    """Fork the ranks, collect ``(kind, payload)`` per rank until all report, one fails (kind
    ``err`` or ``rendezvous``) or ``timeout`` s pass; every rank is dead on return."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "paratron.local_ranks"])
    tmp = tempfile.mkdtemp(prefix="paratron-ranks-")
    store_path = os.path.join(tmp, "store")
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, rank, world_size, store_path, args, kwargs,
                                             child_conn, max(timeout, 30.0), pg_backend), daemon=True)
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)

    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and time.monotonic() < deadline:
            for rank, c in enumerate(conns):
                if rank in results:
                    continue
                if c.poll(0.01):
                    try:
                        results[rank] = c.recv()
                    except EOFError:
                        results[rank] = ("err", f"rank {rank} exited without a result "
                                                f"(exit code {procs[rank].exitcode})")
                elif not procs[rank].is_alive() and not c.poll(0):
                    results[rank] = ("err", f"rank {rank} died with exit code {procs[rank].exitcode}")
            failed = [r for r, (k, _) in results.items() if k != "ok"]
            if failed:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        try:
            os.remove(store_path)
            os.rmdir(tmp)
        except OSError:
            pass

    return results
