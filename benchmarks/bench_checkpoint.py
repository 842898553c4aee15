"""Checkpoint save/load throughput against raw writes and reads of the same bytes, and the
training stall of an async save against a sync save.

    .venv/bin/python benchmarks/bench_checkpoint.py [--mb 256] [--repeats 30] [--big-mb 4096]
        [--big-repeats 10] [--cases "1 rank,sharded,replicated"] [--raw-threads 2] [--dir /tmp]
        [--paratron DIR] [--json FILE] [--no-stall]

``--paratron DIR`` measures the paratron package of another checkout (e.g. an older commit,
``git archive <commit> paratron | tar -x -C DIR``) with this script, so two versions can be run in
turn under the same load and compared by their ratios to the raw side measured in the same run.

Model state: 20 fp32 tensors, ``--mb`` MB in all, marked as parameters of their full logical
tensors. Cases at ``--mb`` (overhead-bound):

* 1 rank: the whole state.
* 4 ranks, sharded: each tensor split by rows over 4 ranks (TP-like), 1/4 of the bytes per rank.
* 4 ranks, replicated: every rank holds everything (pure DP); the save writes each tensor once,
  spread over the ranks.

and 4 sharded ranks again at ``--big-mb`` (16x the bytes by default, where I/O dominates).

Save = ``CheckpointManager.save`` (inf/NaN check, DCP files with fsync, checksums, manifest,
rename, ``latest``); load = ``CheckpointManager.load`` into the same layout (checksums verified).
Deleting the previous checkpoint (``keep_last``) runs in the manager's background thread and is
waited for outside the timing, as the raw side's files are deleted outside its timing. Two raw
writers of each rank's share of the bytes (all on one rank; a quarter on each of 4 ranks, in the
replicated case every 4th tensor):

* matched: one file per rank, ``ndarray.tofile`` + one fsync;
* parallel: ``--raw-threads`` files per rank written in parallel by as many threads, unbuffered
  ``os.write`` straight from the tensors' memory, one fsync per file;

and "best raw" is, per repeat, the faster of the two (on loaded cores the parallel one can lose).

The raw read reads the bytes the load needs (its own file; with replicated state all 4 files,
since every rank loads the whole state) into the module's tensors with ``readinto``. Reads hit
the page cache on both sides. Each repeat runs the save and both raw writes, then the load and
the raw read, the checkpoint side first in even repeats and last in odd ones; per repeat the
slowest rank's seconds. GB/s = state bytes / median seconds; ratios: raw / checkpoint seconds of
the same repeat, as median [min-max] over the repeats. Also printed: the load average before and
after, and the speeds of zlib's CRC-32 and CRC-32C (older checkpoints) and XXH3-64 (new ones) over the state bytes
in memory (the checksums' cost).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

if __name__ == "__main__" and "--paratron" in sys.argv:  # before paratron is imported
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--paratron") + 1]).resolve()))
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paratron.checkpoint.manager import CheckpointManager  # noqa: E402
from paratron.config import CheckpointConfig, Config  # noqa: E402
from paratron.parallel.context import ParallelContext  # noqa: E402
from paratron.parallel.params import ShardSpec, mark  # noqa: E402
from paratron.local_ranks import run_ranks  # noqa: E402

N_TENSORS, COLS = 20, 1000


def state_module(total_mb: float, shards: int, index: int) -> torch.nn.Module:
    """``N_TENSORS`` params of the full shape ``[rows, COLS]``; this rank's ``index``-th row block
    of ``shards`` (``shards=1``: the full tensors)."""
    rows = int(total_mb * 1e6 / 4 / N_TENSORS / COLS) // 4 * 4
    m = torch.nn.Module()
    for i in range(N_TENSORS):
        n = rows // shards
        p = torch.nn.Parameter(torch.full((n, COLS), float(i)), requires_grad=False)
        mark(p, f"w{i}", ShardSpec((rows, COLS), (index * n, 0), (n, COLS)), partition_dim=0 if shards > 1 else -1)
        m.register_parameter(f"w{i}", p)
    return m


def state_bytes(m: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def _params(m: torch.nn.Module, share: tuple[int, int]) -> list[torch.Tensor]:
    i, n = share
    return [p.detach() for p in list(m.parameters())[i::n]]


def raw_write_matched(m: torch.nn.Module, path: Path, share: tuple[int, int] = (0, 1)) -> float:
    """Seconds to write the module's bytes into one file with numpy, then fsync (one file per
    rank, written by one thread, one fsync); with ``share=(i, n)``
    only every n-th tensor from the i-th (this rank's part of replicated state)."""
    arrays = [p.numpy() for p in _params(m, share)]
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _write_file(path: Path, tensors: list[torch.Tensor]) -> None:
    """One file: unbuffered ``os.write`` of each tensor's memory, one fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            while len(view):
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write_best(m: torch.nn.Module, path: Path, share: tuple[int, int] = (0, 1), threads: int = 2) -> float:
    """Seconds for a best-case raw write of the same bytes: ``threads`` files written in parallel
    (one thread each, the tensors dealt round-robin), unbuffered writes straight from the
    tensors' memory, one fsync per file, all in parallel."""
    groups = [g for g in (_params(m, share)[j::threads] for j in range(threads)) if g]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(groups)) as pool:
        list(pool.map(lambda jg: _write_file(path.with_suffix(f".{jg[0]}"), jg[1]), enumerate(groups)))
    return time.perf_counter() - t0


def remove_raw(path: Path) -> None:
    for p in [path, *path.parent.glob(path.stem + ".*")]:
        p.unlink(missing_ok=True)


def raw_read(m: torch.nn.Module, files: list[tuple[Path, int, int]]) -> float:
    """Seconds to read files written by :func:`raw_write_matched` (``(path, i, n)``: its share)
    back into the module's tensors with ``readinto``, as a load fills them."""
    params = list(m.parameters())
    t0 = time.perf_counter()
    for path, i, n in files:
        with open(path, "rb", buffering=0) as f:
            for p in params[i::n]:
                view = memoryview(p.detach().reshape(-1).view(torch.uint8).numpy())
                assert f.readinto(view) == len(view)
    return time.perf_counter() - t0


def measure(ctx, m: torch.nn.Module, workdir: Path, tag: str, repeats: int, sync_group=None,
            share: tuple[int, int] = (0, 1), threads: int = 2) -> dict:
    """Save/load/raw seconds on this rank, one per repeat; ``sync_group`` lines the ranks up
    between phases. The order alternates: even repeats run the checkpoint side first, odd ones
    the raw side (save against both raw writers, then load against the raw read)."""
    barrier = (lambda: sync_group.barrier()) if sync_group is not None else (lambda: None)
    cfg = Config()
    root = workdir / f"ck-{tag}"
    cfg.checkpoint.save = str(root)
    cfg.checkpoint.keep_last = 1
    mgr = CheckpointManager(cfg.checkpoint, ctx, cfg)
    loader = CheckpointManager(CheckpointConfig(load=str(root), load_optimizer=False), ctx, cfg)
    res = {k: [] for k in ("save", "load", "raw_write", "raw_best", "raw_read")}
    raw = workdir / f"raw-{tag}-{ctx.rank}.bin"
    best = workdir / f"best-{tag}-{ctx.rank}.bin"
    n = share[1]
    # The raw read takes the bytes the load needs: the rank's own file, or with replicated state
    # every rank's file (a replicated load reads the whole state on every rank).
    files = [(workdir / f"raw-{tag}-{j}.bin", j, n) for j in range(n)] if n > 1 else [(raw, 0, 1)]

    def timed(key, fn):
        barrier()
        t0 = time.perf_counter()
        out = fn()
        res[key].append(out if isinstance(out, float) else time.perf_counter() - t0)
        barrier()

    def save() -> None:
        mgr.save(len(res["save"]) + 1, [m], None, None, {})

    def load() -> None:
        loader.load([m], None, None)

    writes = [("save", save), ("raw_write", lambda: raw_write_matched(m, raw, share)),
              ("raw_best", lambda: raw_write_best(m, best, share, threads))]
    reads = [("load", load), ("raw_read", lambda: raw_read(m, files))]
    for r in range(repeats):
        for key, fn in (writes if r % 2 == 0 else writes[::-1]):
            timed(key, fn)
            mgr.wait()  # the previous checkpoint's deletion runs in the background, outside the timing
        for key, fn in (reads if r % 2 == 0 else reads[::-1]):
            timed(key, fn)
        remove_raw(best)
        barrier()
        raw.unlink()
    return res


def spread(values: list[float]) -> str:
    """``median [min-max]`` of paired ratios."""
    q = sorted(values)
    return f"{statistics.median(q):.2f} [{q[0]:.2f}-{q[-1]:.2f}]"


def summarise(per_rank: list[dict]) -> dict:
    """Per repeat the slowest rank's seconds; their medians, and the paired ratios raw /
    checkpoint of each repeat (the two ran back to back, under about the same load)."""
    n = len(per_rank[0]["save"])
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(n)] for k in per_rank[0]}
    out = {k: statistics.median(v) for k, v in slowest.items()}
    out["save_ratio"] = [w / s for w, s in zip(slowest["raw_write"], slowest["save"])]
    # Best case: the faster raw writer of the repeat (on loaded cores the parallel one can lose).
    out["best_ratio"] = [min(w, b) / s for w, b, s in zip(slowest["raw_write"], slowest["raw_best"], slowest["save"])]
    out["slowest"] = slowest
    out["load_ratio"] = [r / t for r, t in zip(slowest["raw_read"], slowest["load"])]
    return out


def _ranks(kind: str, mb: float, workdir: str, repeats: int, threads: int):
    ctx = ParallelContext.build()
    shards = 4 if kind == "sharded" else 1
    m = state_module(mb, shards, ctx.rank if shards > 1 else 0)
    share = (ctx.rank, ctx.world_size) if shards == 1 else (0, 1)
    return measure(ctx, m, Path(workdir), kind, repeats, sync_group=ctx.world, share=share, threads=threads)


def stall(workdir: Path, mb: float, repeats: int) -> dict:
    """Seconds ``save`` blocks (sync vs async), and a compute step's time during an async write."""
    ctx = ParallelContext.single()
    m = state_module(mb, 1, 0)
    cfg = Config()
    cfg.checkpoint.save = str(workdir / "ck-stall")
    cfg.checkpoint.keep_last = 1
    mgr = CheckpointManager(cfg.checkpoint, ctx, cfg)
    a = torch.randn(384, 384)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        return time.perf_counter() - t0

    out = {"sync": [], "async": [], "write_async": [], "step_idle": [], "step_during": []}
    for i in range(repeats):
        out["step_idle"].append(statistics.median(step() for _ in range(5)))
        mgr.wait()  # saves are many steps apart: the previous one's cleanup has finished
        mgr.save(2 * i + 1, [m], None, None, {}, async_=False)
        out["sync"].append(mgr.last_stall_s)
        mgr.wait()
        mgr.save(2 * i + 2, [m], None, None, {}, async_=True)
        out["async"].append(mgr.last_stall_s)
        during = []
        while mgr.writing and len(during) < 1000:
            during.append(step())
        mgr.wait()
        out["write_async"].append(mgr.last_write_s)
        out["step_during"].append(statistics.median(during) if during else float("nan"))
    return {k: statistics.median(v) for k, v in out.items()}


def crc_speed(mb: float) -> dict[str, float]:
    """Seconds for the checksums over the state bytes in memory: zlib's CRC-32 and google-crc32c's
    CRC-32C (older checkpoints) and xxhash's XXH3-64 (new ones), called here directly, so as not
    to depend on either checkout."""
    import zlib

    import google_crc32c
    import xxhash

    m = state_module(mb, 1, 0)
    out = {}
    for name, fn in (("zlib CRC-32", zlib.crc32), ("CRC-32C", lambda b: google_crc32c.extend(0, b)),
                     ("XXH3-64", xxhash.xxh3_64_intdigest)):
        t0 = time.perf_counter()
        for p in m.parameters():
            fn(p.detach().numpy())  # an ndarray: google_crc32c refuses memoryviews, takes this without a copy
        out[name] = time.perf_counter() - t0
    return out


def throughput(workdir: Path, mb: float, repeats: int, cases: list[str], threads: int, record: dict) -> None:
    """The save/load table of one state size; each case's per-repeat seconds into ``record``."""
    gb = state_module(mb, 1, 0)
    total = state_bytes(gb) / 1e9
    del gb
    print(f"\nstate: {total * 1e3:.0f} MB fp32 in {N_TENSORS} tensors; {repeats} repeats, order alternated; "
          f"ratios: median [min-max] over the repeats of raw / checkpoint seconds of the same repeat (slowest rank)")
    print("| case | save GB/s | raw write GB/s matched / parallel | save / matched raw | save / best raw "
          "| load GB/s | raw read GB/s | load / raw read |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in cases:
        if kind == "1 rank":
            r = summarise([measure(ParallelContext.single(), state_module(mb, 1, 0), workdir, "one", repeats,
                                   threads=threads)])
        else:
            r = summarise(run_ranks(_ranks, 4, kind, mb, str(workdir), repeats, threads, timeout=3600))
        record[f"{mb:g} MB, {kind}"] = r["slowest"]
        print(f"| {kind if kind == '1 rank' else '4 ranks, ' + kind} | {total / r['save']:.2f} | "
              f"{total / r['raw_write']:.2f} / {total / r['raw_best']:.2f} | {spread(r['save_ratio'])} | "
              f"**{spread(r['best_ratio'])}** | {total / r['load']:.2f} | {total / r['raw_read']:.2f} | "
              f"**{spread(r['load_ratio'])}** |", flush=True)


def main(args) -> None:
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        import paratron

        print(f"paratron from {Path(paratron.__file__).parent}; load average {os.getloadavg()}")
        record: dict = {}
        cases = [c for c in args.cases.split(",") if c]
        if cases:
            throughput(workdir, args.mb, args.repeats, cases, args.raw_threads, record)
        if args.big_mb:
            throughput(workdir, args.big_mb, args.big_repeats, ["sharded"], args.raw_threads, record)
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1))
        print(f"load average after the throughput tables {os.getloadavg()}", flush=True)
        if args.no_stall:
            return
        s = stall(workdir, args.mb, min(args.repeats, 5))
        total = args.mb / 1e3
        print()
        print("| save mode | training stall (s) | write until committed (s) |")
        print("|---|---|---|")
        print(f"| sync | {s['sync']:.3f} | {s['sync']:.3f} |")
        print(f"| async | {s['async']:.3f} | {s['write_async']:.3f} |")
        print(f"async stall / sync stall: **{s['async'] / s['sync']:.2f}**; a compute step takes "
              f"{s['step_idle'] * 1e3:.1f} ms idle, {s['step_during'] * 1e3:.1f} ms while the async write runs "
              f"({s['step_during'] / s['step_idle']:.2f}x)")
        speeds = ", ".join(f"{k} {total / v:.2f} GB/s" for k, v in crc_speed(args.mb).items())
        print(f"over the state in memory: {speeds}; load average at the end {os.getloadavg()}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--big-mb", type=float, default=4096.0,
                        help="the size where I/O dominates, 4 sharded ranks only (0: skip)")
    parser.add_argument("--big-repeats", type=int, default=10)
    parser.add_argument("--raw-threads", type=int, default=2, help="files (threads) per rank of the best raw write")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--paratron", default=None, help="the checkout whose paratron package to measure")
    parser.add_argument("--cases", default="1 rank,sharded,replicated",
                        help="comma-separated cases at --mb: '1 rank', sharded, replicated")
    parser.add_argument("--json", default=None, help="write every repeat's seconds (slowest rank) here")
    parser.add_argument("--no-stall", action="store_true", help="only the throughput table")
    main(parser.parse_args())
