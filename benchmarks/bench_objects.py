"""Object collectives on gloo: ``paratron.parallel.objects`` against ``torch.distributed``'s own
``all_gather_object`` / ``gather_object``, on the same objects, paired.

The object is what a checkpoint save exchanges: a list of ``--items`` small tuples (a DCP plan's
write items stand in as ``(name, index, shape)``), every rank's of another length (rank ``r``
sends ``items + r``). ``--ranks`` gloo ranks (default 4, on this 2-core host the ranks share the
cores, as the checkpoint benchmark's do), one thread each. Timed with ``pairing.time_paired``
(order reversed every other step, the slowest rank's time, ``--steps`` >= 30); printed as JSON:
median ms per variant, the paired ratio against torch's (median of per-step ratios,
interquartile range, min-max), load average before and after.

Usage: .venv/bin/python benchmarks/bench_objects.py [--ranks 4] [--items 20] [--steps 100]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from paratron.local_ranks import run_ranks  # noqa: E402
from paratron.parallel.objects import all_gather_objects, gather_objects  # noqa: E402
from pairing import MIN_TIMED_STEPS, load, summarize, time_paired  # noqa: E402


def _ranks(items: int, steps: int) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    obj = [(f"model/layers.{i}.weight", i, (1000, 1000)) for i in range(items + rank)]
    pg = dist.new_group(backend="gloo")
    out = {}

    def torch_all(_):
        dist.all_gather_object([None] * size, obj, group=pg)

    def torch_gather(_):
        dist.gather_object(obj, [None] * size if rank == 0 else None, dst=0, group=pg)

    variants = {"torch all_gather_object": torch_all,
                "objects.all_gather_objects": lambda _: all_gather_objects(obj, pg),
                "torch gather_object": torch_gather,
                "objects.gather_objects": lambda _: gather_objects(obj, pg, group_dst=0)}
    for pair in (list(variants)[:2], list(variants)[2:]):
        times = time_paired(pair, steps, lambda name, step: variants[name](step))
        out[pair[0].split()[-1]] = summarize(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--items", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    if args.steps < MIN_TIMED_STEPS:
        ap.error(f"--steps must be >= {MIN_TIMED_STEPS}")
    before = load()
    res = run_ranks(_ranks, args.ranks, args.items, args.steps, timeout=600)[0]
    print(json.dumps({"ranks": args.ranks, "items": args.items, "load_before": before, "load_after": load(),
                      **res}, indent=1))


if __name__ == "__main__":
    main()
