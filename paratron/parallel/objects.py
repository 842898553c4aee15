"""Object collectives on the host in fewer, cheaper rounds than ``torch.distributed``'s.

``dist.all_gather_object`` and ``dist.gather_object`` first all-gather every rank's pickled size,
then all-gather (or gather) the pickles padded to the largest. On gloo, 4 ranks sharing 2 cores,
one all-gather of a few bytes took ~3.7 ms, against ~0.5 ms for an all-reduce of one integer and
~0.3-1 ms for a gather or a broadcast of a few kB; a checkpoint save runs one object all-gather
and one object gather. Here the sizes are one MAX all-reduce (every rank pads to the largest),
and the bytes one gather to the destination (for the all-gather then one broadcast of all of them
from there). ``benchmarks/bench_objects.py`` (4 ranks, the slowest rank's time, paired): the
all-gather 0.33-0.39x and the gather 0.39-0.42x torch's time (benchmarks/README.md).

That is three rounds where torch takes two, but none of them is gloo's all-gather: for the small
control objects these carry (plans, outcomes, write results) each round's latency, not the
bytes, is the cost. The root receives and sends every rank's padded bytes (ranks x the largest
pickle), which is what an all-gather delivers to every rank anyway.

Each rank's buffer is its pickle's length (8 bytes, little-endian), the pickle, then zeros up to
the largest rank's. The tensors are CPU ``uint8``: the process group needs a CPU backend (gloo).
Like torch's object collectives these unpickle what the other ranks sent; they are for ranks of
one job, which trust each other.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

_LENGTH = 8  # bytes of the length prefix


def _packed(obj, pg) -> torch.Tensor:
    """This rank's pickle of ``obj`` framed and padded to the group's largest frame (one MAX
    all-reduce of the lengths)."""
    raw = pickle.dumps(obj)
    longest = torch.tensor([len(raw)], dtype=torch.int64)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=pg)
    body = bytearray(len(raw).to_bytes(_LENGTH, "little") + raw)
    frame = torch.zeros(_LENGTH + int(longest), dtype=torch.uint8)
    frame[:len(body)] = torch.frombuffer(body, dtype=torch.uint8)
    return frame


def _unpacked(frame: torch.Tensor):
    data = frame.numpy().tobytes()
    n = int.from_bytes(data[:_LENGTH], "little")
    return pickle.loads(data[_LENGTH:_LENGTH + n])


def gather_objects(obj, pg, group_dst: int = 0) -> list | None:
    """Every rank's ``obj`` on the group's rank ``group_dst``, in group-rank order (None on the
    others). Call on every rank of ``pg``, as ``dist.gather_object``.

    Raises:
        pickle.PicklingError, TypeError: ``obj`` cannot be pickled (raised before any collective
            only on that rank: the others then wait in the size all-reduce, as with torch's).
        RuntimeError: the backend's own errors (a rank gone, a timeout).
    """
    size, me = dist.get_world_size(pg), dist.get_rank(pg)
    frame = _packed(obj, pg)
    frames = [torch.empty_like(frame) for _ in range(size)] if me == group_dst else None
    dist.gather(frame, frames, group=pg, group_dst=group_dst)
    return None if frames is None else [_unpacked(f) for f in frames]


def all_gather_objects(obj, pg) -> list:
    """Every rank's ``obj`` on every rank, in group-rank order. Call on every rank of ``pg``,
    as ``dist.all_gather_object``.

    Raises:
        As :func:`gather_objects`.
    """
    size, me = dist.get_world_size(pg), dist.get_rank(pg)
    frame = _packed(obj, pg)
    every = torch.empty(size * frame.numel(), dtype=torch.uint8)
    dist.gather(frame, list(every.chunk(size)) if me == 0 else None, group=pg, group_dst=0)
    dist.broadcast(every, group=pg, group_src=0)
    return [_unpacked(f) for f in every.chunk(size)]
