"""An ordered map over worker processes, for preprocessing.

Each worker is handed the function once at start (no per-task pickling of a tokenizer, and no
module-level state to hold it); tasks and results travel through queues and results come back in
task order. At most ``2 * workers`` tasks are in flight, so memory stays bounded on big corpora.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from typing import Any, Callable, Iterable, Iterator


class WorkerError(RuntimeError):
    """A worker raised or died; the message carries its traceback or exit code."""


def _serve(fn: Callable[[Any], Any], tasks, results) -> None:
    # Each worker is one of N processes on N cores: the tokenizer library's own thread pool would
    # only oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    for seq, item in iter(tasks.get, None):
        try:
            results.put((seq, fn(item), None))
        except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
            results.put((seq, None, traceback.format_exc()))


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int = 1) -> Iterator[Any]:
    """``map(fn, items)`` on ``workers`` processes (in this process when ``workers <= 1``), in order.

    Raises:
        WorkerError: a worker's exception (with its traceback) or a worker that died.
    """
    if workers <= 1:
        yield from map(fn, items)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_serve, args=(fn, tasks, results), daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    try:
        it = iter(items)
        sent = done = 0
        exhausted = False
        pending: dict[int, Any] = {}
        while True:
            while not exhausted and sent - done < 2 * workers:
                try:
                    tasks.put((sent, next(it)))
                    sent += 1
                except StopIteration:
                    exhausted = True
            if exhausted and done == sent:
                return
            try:
                seq, res, err = results.get(timeout=2.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise WorkerError(f"preprocess worker pid {dead[0].pid} died with exit code "
                                      f"{dead[0].exitcode}") from None
                continue
            if err is not None:
                raise WorkerError(f"preprocess worker failed:\n{err}")
            pending[seq] = res
            while done in pending:
                yield pending.pop(done)
                done += 1
    finally:
        for _ in procs:
            tasks.put(None)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
