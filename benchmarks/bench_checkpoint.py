"""Checkpoint save/load throughput against a raw numpy write of the same bytes, and the training
stall of an async save against a sync save.

    .venv/bin/python benchmarks/bench_checkpoint.py [--mb 256] [--repeats 3] [--dir /tmp] [--paratron DIR]

``--paratron DIR`` measures the paratron package of another checkout (e.g. an older commit,
``git archive <commit> | tar -x -C DIR``) with this script, so two versions can be run in turn
under the same load and compared by their ratios to the raw write measured in the same run.

Model state: 20 fp32 tensors, ``--mb`` MB in all, marked as parameters of their full logical
tensors. Cases:

* 1 rank: the whole state.
* 4 ranks, sharded: each tensor split by rows over 4 ranks (TP-like), 1/4 of the bytes per rank.
* 4 ranks, replicated: every rank holds everything (pure DP); the save writes each tensor once,
  spread over the ranks.

Save = ``CheckpointManager.save`` (inf/NaN check, DCP files with fsync, checksums, manifest,
rename, ``latest``); load = ``CheckpointManager.load`` into the same layout (checksums verified).
Deleting the previous checkpoint (``keep_last``) runs in the manager's background thread and is
waited for outside the timing, as the raw side's file is deleted outside its timing. Baseline:
each rank writes its share of the bytes into one file (all on one rank; a quarter on each of 4
ranks, in the replicated case every 4th tensor) with ``ndarray.tofile`` + fsync: one payload file
per rank and one fsync each, as the save. The raw read reads the bytes the load needs (its own
file; with replicated state all 4 files, since every rank loads the whole state) into the
module's tensors with ``readinto``. Reads hit the page cache on both sides. GB/s = state bytes / seconds; median of ``--repeats`` runs, slowest
rank; ratios: median over the repeats of each repeat's raw / checkpoint. Also printed: zlib's
CRC-32 (older checkpoints) and CRC-32C (new ones) speeds over the state bytes in memory (the
checksums' cost).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
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


def raw_write(m: torch.nn.Module, path: Path, share: tuple[int, int] = (0, 1)) -> float:
    """Seconds to write the module's bytes into one file with numpy, then fsync; with
    ``share=(i, n)`` only every n-th tensor from the i-th (this rank's part of replicated state)."""
    i, n = share
    arrays = [p.detach().numpy() for p in list(m.parameters())[i::n]]
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_read(m: torch.nn.Module, files: list[tuple[Path, int, int]]) -> float:
    """Seconds to read files written by :func:`raw_write` (``(path, i, n)``: its share) back
    into the module's tensors, as a load fills them."""
    params = list(m.parameters())
    t0 = time.perf_counter()
    for path, i, n in files:
        with open(path, "rb", buffering=0) as f:
            for p in params[i::n]:
                view = memoryview(p.detach().numpy()).cast("B")
                assert f.readinto(view) == len(view)
    return time.perf_counter() - t0


def measure(ctx, m: torch.nn.Module, workdir: Path, tag: str, repeats: int, sync_group=None,
            share: tuple[int, int] = (0, 1)) -> dict:
    """Save/load/raw seconds on this rank, one per repeat; ``sync_group`` lines the ranks up
    between phases."""
    barrier = (lambda: sync_group.barrier()) if sync_group is not None else (lambda: None)
    cfg = Config()
    root = workdir / f"ck-{tag}"
    cfg.checkpoint.save = str(root)
    cfg.checkpoint.keep_last = 1
    mgr = CheckpointManager(cfg.checkpoint, ctx, cfg)
    loader = CheckpointManager(CheckpointConfig(load=str(root), load_optimizer=False), ctx, cfg)
    res = {"save": [], "load": [], "raw_write": [], "raw_read": []}
    for step in range(1, repeats + 1):
        barrier()
        t0 = time.perf_counter()
        mgr.save(step, [m], None, None, {})
        res["save"].append(time.perf_counter() - t0)
        mgr.wait()  # the previous checkpoint's deletion, which overlaps training in a real run
        barrier()
        t0 = time.perf_counter()
        loader.load([m], None, None)
        res["load"].append(time.perf_counter() - t0)
        barrier()
        raw = workdir / f"raw-{tag}-{ctx.rank}.bin"
        res["raw_write"].append(raw_write(m, raw, share))
        barrier()
        # The raw read takes the bytes the load needs: the rank's own file, or with replicated
        # state every rank's file (a replicated load reads the whole state on every rank).
        n = share[1]
        files = [(workdir / f"raw-{tag}-{j}.bin", j, n) for j in range(n)] if n > 1 else [(raw, 0, 1)]
        res["raw_read"].append(raw_read(m, files))
        barrier()
        os.remove(raw)
    return res


def summarise(per_rank: list[dict]) -> dict:
    """Per repeat the slowest rank's seconds; their medians, and the medians of the per-repeat
    ratios raw / checkpoint (save and raw write of one repeat ran back to back, under about the
    same load)."""
    n = len(per_rank[0]["save"])
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(n)] for k in per_rank[0]}
    out = {k: statistics.median(v) for k, v in slowest.items()}
    out["save_ratio"] = statistics.median(w / s for w, s in zip(slowest["raw_write"], slowest["save"]))
    out["load_ratio"] = statistics.median(r / t for r, t in zip(slowest["raw_read"], slowest["load"]))
    return out


def _ranks(kind: str, mb: float, workdir: str, repeats: int):
    ctx = ParallelContext.build()
    shards = 4 if kind == "sharded" else 1
    m = state_module(mb, shards, ctx.rank if shards > 1 else 0)
    share = (ctx.rank, ctx.world_size) if shards == 1 else (0, 1)
    return measure(ctx, m, Path(workdir), kind, repeats, sync_group=ctx.world, share=share)


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
    """Seconds for zlib's CRC-32 (older checkpoints) and google-crc32c's CRC-32C (new ones) over
    the state bytes in memory (called here directly, so as not to depend on either checkout)."""
    import zlib

    import google_crc32c

    m = state_module(mb, 1, 0)
    out = {}
    for name, fn in (("zlib CRC-32", zlib.crc32), ("CRC-32C", lambda b: google_crc32c.extend(0, b))):
        t0 = time.perf_counter()
        for p in m.parameters():
            fn(p.detach().numpy())  # an ndarray: google_crc32c refuses memoryviews, takes this without a copy
        out[name] = time.perf_counter() - t0
    return out


def main(args) -> None:
    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=args.dir))
    try:
        gb = state_module(args.mb, 1, 0)
        total = state_bytes(gb) / 1e9
        del gb
        import paratron

        print(f"paratron from {Path(paratron.__file__).parent}; load average {os.getloadavg()[0]:.1f}")
        print(f"state: {total * 1e3:.0f} MB fp32 in {N_TENSORS} tensors; median of {args.repeats}")
        print("| case | save GB/s | raw write GB/s | save / raw | load GB/s | raw read GB/s | load / raw |")
        print("|---|---|---|---|---|---|---|")
        one = measure(ParallelContext.single(), state_module(args.mb, 1, 0), workdir, "one", args.repeats)
        rows = [("1 rank", summarise([one]))]
        for kind in ("sharded", "replicated"):
            per_rank = run_ranks(_ranks, 4, kind, args.mb, str(workdir), args.repeats, timeout=1800)
            rows.append((f"4 ranks, {kind}", summarise(per_rank)))
        for name, r in rows:
            print(f"| {name} | {total / r['save']:.2f} | {total / r['raw_write']:.2f} | **{r['save_ratio']:.2f}** | "
                  f"{total / r['load']:.2f} | {total / r['raw_read']:.2f} | {r['load_ratio']:.2f} |")
        if args.no_stall:
            return
        s = stall(workdir, args.mb, args.repeats)
        print()
        print("| save mode | training stall (s) | write until committed (s) |")
        print("|---|---|---|")
        print(f"| sync | {s['sync']:.3f} | {s['sync']:.3f} |")
        print(f"| async | {s['async']:.3f} | {s['write_async']:.3f} |")
        print(f"async stall / sync stall: **{s['async'] / s['sync']:.2f}**; a compute step takes "
              f"{s['step_idle'] * 1e3:.1f} ms idle, {s['step_during'] * 1e3:.1f} ms while the async write runs "
              f"({s['step_during'] / s['step_idle']:.2f}x)")
        speeds = ", ".join(f"{k} {total / v:.2f} GB/s" for k, v in crc_speed(args.mb).items())
        print(f"over the state in memory: {speeds}; load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=256.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--paratron", default=None, help="the checkout whose paratron package to measure")
    parser.add_argument("--no-stall", action="store_true", help="only the throughput table")
    main(parser.parse_args())
