"""The hang diagnosis: one message from the ranks' ring-buffer dumps (``RUN_DIR/hang/rank_N.json``).

Each dump (written by :mod:`paratron.launch.watchdog`) holds the rank's last ops and, per process
group (its ranks), how many ops it has entered. An op is identified across ranks by
``(group ranks, seq)``. The diagnosis:

1. Each rank's *stuck op* is its oldest open entry.
2. The *root* is the stuck op earliest in program order, i.e. the lowest ``(step, start time)``
   among stuck ops that some member of its group never entered (its count for that group is
   below ``seq``). Ranks that got stuck later (a later step, or waiting on the stuck ones) are
   consequences. Example: rank 1 skips the last all-reduce of step 3 and runs into step 4; ranks
   0, 2, 3 wait in the step-3 all-reduce, rank 1 waits in a step-4 op; the root is the step-3 op
   and rank 1 is named.
3. The message names the root op (op, group and its ranks, ``seq``, step, shape and dtype), the
   ranks waiting in it and for how long, and for each rank that never entered it the last op it
   completed in that group and where it is now.

Before all that, the rings are compared (:func:`paratron.parallel.collcheck.first_disagreement`):
members of a group whose n-th collectives differ were paired with the wrong op, whatever
followed (a hang, a crash, a mismatch found by the stop agreement), so the first such collective
is named first, with what each rank ran there. That holds for dumps of any reason, and a rank
that left no dump (aborted by gloo, killed) is compared by its black box, ``rank_N.ring``
(:func:`load_rings`).
"""

from __future__ import annotations

import json
from pathlib import Path

from paratron.parallel.collcheck import first_disagreement, mismatch_text
from paratron.parallel.flight import read_black_box


def load_dumps(directory: Path | str, pattern: str = "rank_*.json") -> dict[int, dict]:
    """Every readable JSON record matching ``pattern`` in ``directory`` (each holds its
    ``"rank"``), by rank; unreadable or partial files are skipped. Also reads the launcher's
    error and status records (:func:`paratron.launch.failures.read_records`)."""
    out = {}
    for p in sorted(Path(directory).glob(pattern)):
        try:
            d = json.loads(p.read_text())
            out[int(d["rank"])] = d
        except (OSError, ValueError, KeyError):
            continue
    return out


def load_rings(directory: Path | str, dumps: dict[int, dict]) -> dict[int, list[dict]]:
    """Each rank's ring entries: from its dump in ``dumps``, else from its black box
    ``rank_N.ring`` in ``directory`` (unreadable files are skipped)."""
    rings = {r: d.get("entries", []) for r, d in dumps.items()}
    for p in sorted(Path(directory).glob("rank_*.ring")):
        try:
            rank = int(p.stem.split("_", 1)[1])
            if rank not in rings:
                rings[rank] = read_black_box(p)
        except (OSError, ValueError):
            continue
    return rings


def _key(ranks) -> str:
    return ",".join(map(str, ranks))


def _describe(e: dict) -> str:
    shape = f", shape {e['shape']} {e['dtype']}" if e.get("shape") is not None else ""
    return (f"{e['op']} #{e['seq']} of group {e['group']} (ranks {_key(e['ranks'])}) "
            f"at step {e['step']}{shape}")


def stuck_ops(dumps: dict[int, dict]) -> dict[int, dict]:
    """Each rank's oldest open entry (ranks with none are left out)."""
    out = {}
    for r, d in dumps.items():
        pending = [e for e in d.get("entries", []) if e.get("end") is None]
        if pending:
            out[r] = min(pending, key=lambda e: e["start"])
    return out


def missing_ranks(op: dict, dumps: dict[int, dict]) -> list[int]:
    """Members of ``op``'s group that never entered it (or left no dump to tell)."""
    key = _key(op["ranks"])
    return [m for m in op["ranks"] if m not in dumps or dumps[m].get("counts", {}).get(key, 0) < op["seq"]]


def root_op(dumps: dict[int, dict]) -> tuple[dict, list[int]] | None:
    """The stuck op earliest in program order that some rank never entered, with those ranks."""
    for _, op in sorted(stuck_ops(dumps).items(), key=lambda kv: (kv[1]["step"], kv[1]["start"])):
        missing = missing_ranks(op, dumps)
        if missing:
            return op, missing
    return None


def _last_completed(d: dict, key: str | None = None) -> dict | None:
    done = [e for e in d.get("entries", []) if e.get("end") is not None
            and (key is None or _key(e["ranks"]) == key)]
    return max(done, key=lambda e: e["end"]) if done else None


def diagnose(dumps: dict[int, dict], where: str = "RUN_DIR/hang",
             rings: dict[int, list[dict]] | None = None) -> str | None:
    """The diagnosis text: a collective mismatch between the rings (``rings``, default: the
    dumps' entries; see :func:`load_rings`) when there is one, else the hang; None when neither."""
    rings = rings if rings is not None else {r: d.get("entries", []) for r, d in dumps.items()}
    if first_disagreement(rings) is not None:
        return f"{mismatch_text(rings)}\n  ring buffers: {where}/rank_N.json"
    if not any(d.get("reason") == "hang" for d in dumps.values()):
        return None
    timeout = max(d.get("hang_timeout_s", 0) for d in dumps.values())
    found = root_op(dumps)
    stuck = stuck_ops(dumps)
    if found is None:
        waiting = ", ".join(f"rank {r} in {_describe(e)}" for r, e in sorted(stuck.items()))
        return (f"hang (an op pending > parallel.hang_timeout_s={timeout:g} s): every member of the "
                f"stuck ops entered them: {waiting or 'no open op'}\n  ring buffers: {where}/rank_N.json")
    op, missing = found
    key = _key(op["ranks"])
    waiters = sorted(r for r, e in stuck.items() if _key(e["ranks"]) == key and e["seq"] == op["seq"])
    waited = max(dumps[r]["time"] - stuck[r]["start"] for r in waiters) if waiters else 0.0
    names = ", ".join(map(str, missing))
    lines = [f"hang: rank{'s' if len(missing) > 1 else ''} {names} never entered {_describe(op)}; "
             f"rank{'s' if len(waiters) > 1 else ''} {', '.join(map(str, waiters))} waited in it "
             f"for {waited:.1f} s (parallel.hang_timeout_s={timeout:g})"]
    for m in missing:
        d = dumps.get(m)
        if d is None:
            lines.append(f"  rank {m}: left no ring buffer (it exited or was killed before dumping)")
            continue
        last = _last_completed(d, key)
        now = stuck.get(m)
        lines.append(f"  rank {m}: last completed in that group: "
                     f"{_describe(last) if last else 'nothing in the buffer'}; now "
                     + (f"blocked in {_describe(now)}" if now else "not blocked in any op (busy outside "
                        "collectives: compute, I/O or a loop)"))
    lines.append(f"  ring buffers: {where}/rank_N.json")
    return "\n".join(lines)
