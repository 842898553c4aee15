"""Collectives that do not match: found once a step by default, before every op on request.

gloo and NCCL pair the n-th collective of one rank on a process group with the n-th of every
other member, whatever each one is. A rank that issues an extra collective, or another op,
reduce op, dtype or size at the same number, is paired with the wrong op without a word (unless
the byte counts differ, which gloo aborts on), and the ranks go on with wrong values: a stop flag
read from another rank's metric starts a save on one rank only. Two checks, both fed by the
flight recorder (:mod:`paratron.parallel.flight`), which numbers every rank's collectives per
group (``cseq``) and keeps a running CRC of their signatures:

* **Once a step, by default** (:func:`agree_to_stop`): the stop agreement that ends every step
  carries, for every process group of the layout (a fixed slot each, the same on every rank:
  :func:`group_slots`), each member's ``(count, CRC)`` and its negation, reduced with MAX, so
  that ``max == -max(-x)`` holds only where every member agrees. A tag pair does the same for
  the agreement itself: a member that ran another op here leaves it broken. On a disagreement
  every rank raises :class:`CollectiveMismatch` before the save, after gathering the rings of
  the groups that differ, so the message names the first ``cseq`` where they part and what each
  member ran there. Cost: one host all-reduce of ``3 + 2 * groups`` int64 instead of one float.
* **Before every collective**, with ``parallel.check_collectives = true`` (:func:`exchange`):
  the members all-gather ``(cseq, CRC of this op's signature)`` on the group's CPU backend
  first, and the op runs only when they match. One extra small host round trip per op.

Why not ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: in torch 2.13 its wrapper does work on gloo and
catches another op, shape or dtype, but not another reduce op (SUM paired with MAX passes), its
sequence numbers are the process group's own rather than those of paratron's rings and hang
dumps, and the setting turns on torch's other debug paths as well.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .flight import group_key

TAG = 0x5061726174726F6E  # ascii "Paratron": marks the stop agreement's payload
_NONE = -(2 ** 63)  # a non-member's slot (below every value a member writes)


class CollectiveMismatch(RuntimeError):
    """The members of a process group did not issue the same collectives. The message names the
    group, the first collective number (``cseq``) where they differ and what each rank ran."""


def group_slots(grid) -> dict[tuple[int, ...], int]:
    """Every distinct rank tuple of more than one rank among the layout's groups, numbered in
    sorted order: the same numbering on every rank (each rank knows the whole grid)."""
    keys = {tuple(g) for groups in grid.groups.values() for g in groups if len(g) > 1}
    return {k: i for i, k in enumerate(sorted(keys))}


def _fingerprint(count: int, crc: int) -> int:
    return (count << 32) | crc


def agreement_payload(local: bool, fingerprints: dict, slots: dict) -> torch.Tensor:
    """``[stop, TAG, -TAG, fp_0..fp_K-1, -fp_0..-fp_K-1]`` (int64) of this rank: ``fp_i`` is the
    fingerprint of slot i's group when this rank is a member, else the smallest int64."""
    k = len(slots)
    out = torch.full((3 + 2 * k,), _NONE, dtype=torch.int64)
    out[0], out[1], out[2] = int(local), TAG, -TAG
    for ranks, (count, crc) in fingerprints.items():
        i = slots.get(ranks)
        if i is not None:
            fp = _fingerprint(count, crc)
            out[3 + i], out[3 + k + i] = fp, -fp
    return out


def agree_to_stop(ctx, local: bool) -> bool:
    """Every rank stops at the same step if any rank was asked to (signals arrive unevenly); a
    host-side all-reduce (gloo, the CPU side of the process groups): the device never waits.
    With the flight recorder on, it also checks that every group's members issued the same
    collectives since the start (see the module docstring).

    Raises:
        CollectiveMismatch: some group's members disagree (raised on every rank, before any
            save), or the agreement itself met another op on some rank.
    """
    fr = ctx.ledger.flight
    if fr is None or ctx.world_size == 1:
        t = torch.tensor([1.0 if local else 0.0])
        ctx.world.host_all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0] > 0)
    if fr.slots is None:
        fr.slots = group_slots(ctx.grid)
    slots = fr.slots
    t = agreement_payload(local, fr.fingerprints(), slots)
    ctx.world.host_all_reduce(t, op=dist.ReduceOp.MAX)
    mine = fr.entries()[-1]
    if int(t[1]) != TAG or int(t[2]) != -TAG:
        raise CollectiveMismatch(
            f"rank {ctx.rank}: the stop agreement ({describe(mine.as_dict())}) was paired with another "
            "collective on some rank: the ranks issued different collectives before it; their ring "
            "buffers are in RUN_DIR/hang/ (parallel.check_collectives=true names the op)")
    k = len(slots)
    got = t.tolist()  # every slot has a member, so none is left at _NONE by a real all-reduce
    bad = {ranks for ranks, i in slots.items() if got[3 + i] != _NONE and got[3 + i] != -got[3 + k + i]}
    if bad:
        raise CollectiveMismatch(mismatch_text(gather_rings(ctx.world, fr, bad), bad))
    return bool(got[0])


def gather_rings(world, fr, keys: set) -> dict[int, list[dict]]:
    """Every rank's buffered collectives on the groups ``keys`` (a world all-gather; call only
    where every rank does, e.g. after a failed agreement that every rank saw)."""
    mine = [e.as_dict() for e in fr.entries() if e.cseq is not None and tuple(e.ranks) in keys]
    return dict(enumerate(world.all_gather_object(mine)))


def first_disagreement(rings: dict[int, list[dict]]) -> tuple[dict, dict[int, dict]] | None:
    """The earliest collective (lowest ``(step, start time)``) of some group whose members' rings
    both hold it with different signatures: ``(entry of the lowest such rank, {rank: its entry})``, or
    None. ``rings``: each rank's ring entries (flight-recorder dicts)."""
    by_op: dict[tuple[str, int], dict[int, dict]] = {}
    for rank, entries in rings.items():
        for e in entries:
            if e.get("cseq") is not None and e.get("sig") is not None:
                by_op.setdefault((_key(e), e["cseq"]), {})[rank] = e
    found = [ops for ops in by_op.values() if len({e["sig"] for e in ops.values()}) > 1]
    if not found:
        return None
    ops = min(found, key=lambda o: min((e["step"], e["start"]) for e in o.values()))
    return ops[min(ops)], ops


def _key(e: dict) -> str:
    """The group key of a ring entry (a black-box record carries it; a JSON entry its ranks)."""
    return e.get("key") or group_key(e["ranks"])


def describe(e: dict) -> str:
    """``collective #cseq of group G (ranks ...) at step S: signature``."""
    return (f"collective #{e['cseq']} of group {e['group']} (ranks {_key(e)}) "
            f"at step {e['step']}: {e['sig']}")


def mismatch_text(rings: dict[int, list[dict]], keys: set | None = None) -> str:
    """The diagnosis: the first collective the ranks disagree on, one line per rank."""
    found = first_disagreement(rings)
    if found is None:
        names = "; ".join(",".join(map(str, k)) for k in sorted(keys or ()))
        return (f"collective mismatch: the members of group(s) with ranks {names} issued different "
                "collectives, earlier than their ring buffers reach")
    return _per_rank(*found)


def _per_rank(first: dict, ops: dict[int, dict]) -> str:
    lines = [f"collective mismatch at collective #{first['cseq']} of group {first['group']} "
             f"(ranks {_key(first)}): the ranks ran different ops there"]
    lines += [f"  rank {r}: #{e['cseq']} {e['sig']} at step {e['step']}" for r, e in sorted(ops.items())]
    return "\n".join(lines)


def exchange(pg, size: int, entry) -> None:
    """``parallel.check_collectives``: all-gather ``(cseq, CRC of the signature)`` of ``entry`` over
    the group's CPU backend before the op runs.

    Raises:
        CollectiveMismatch: the members are about to run different ops (raised on every member,
            naming each one's op).
    """
    mine = torch.tensor([entry.cseq, zlib.crc32(entry.sig.encode())], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(rows, mine, group=pg)
    if all(torch.equal(r, mine) for r in rows):
        return
    theirs = [None] * size
    dist.all_gather_object(theirs, entry.as_dict(), group=pg)
    raise CollectiveMismatch(_per_rank(theirs[0], dict(zip(entry.ranks, theirs))))
