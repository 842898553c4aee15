"""The launcher's one summary of a failed job: who failed first, with what, and where.

Sources (all under ``RUN_DIR``): the ranks' error records ``logs/rank_N.error.json`` and status
records ``logs/rank_N.status.json`` (:mod:`paratron.launch.rankproc`), the times at which the
launcher saw each rank's process disappear, the exit codes torchrun reports in
``logs/torchrun.log``, and the hang dumps ``hang/rank_N.json`` (:mod:`paratron.launch.hang`).

*First* means: the earliest failure that is not a consequence of another. A rank that lost a
peer (gloo "connection closed/reset by peer", a communication timeout, torch's
``DistBackendError``) or that was stopped after the first failure is a consequence; an exception
of any other kind, or a death without a Python error (SIGKILL, the OOM killer, an abort), is not.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from paratron.launch.hang import load_dumps

CONSEQUENCE_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "PeerCheckpointError"}
CONSEQUENCE_TEXT = ("closed by peer", "reset by peer", "broken pipe", "timed out", "timeout",
                    "connection refused", "read error", "write error")


@dataclass
class Failure:
    rank: int
    time: float
    text: str
    where: str | None = None
    step: int | None = None
    consequence: bool = False
    save: int | None = None
    """The iteration whose checkpoint save the failure interrupted (None: not in a save)."""

    def when(self) -> str:
        """`` while saving the checkpoint of iteration N``, `` at step N``, or nothing."""
        if self.save is not None:
            return f" while saving the checkpoint of iteration {self.save}"
        return f" at step {self.step}" if self.step else ""


def read_records(log_dir: Path, suffix: str) -> dict[int, dict]:
    """The ranks' ``rank_N.<suffix>.json`` records (``error`` or ``status``), by rank."""
    return load_dumps(log_dir, f"rank_*.{suffix}.json")


def torchrun_exit_codes(text: str) -> dict[int, int]:
    """``{rank: exitcode}`` from torchrun's ChildFailedError report (empty if absent)."""
    pat = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
    return {int(r): int(c) for r, c in pat.findall(text)}


def _signal_text(code: int | None) -> str:
    if code is None:
        return "died without a Python error (killed by a signal, the OOM killer or an abort)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"died by {name} (no Python error)"
    return f"exited with code {code} without a Python error"


def _is_consequence(rec: dict) -> bool:
    msg = rec.get("message", "").lower()
    return rec.get("type") in CONSEQUENCE_TYPES or any(t in msg for t in CONSEQUENCE_TEXT)


def collect(log_dir: Path, deaths: dict[int, float], exit_codes: dict[int, int]) -> list[Failure]:
    """Every rank's failure, earliest first; a rank that died after an error record is listed once."""
    out = []
    for r, rec in read_records(log_dir, "error").items():
        out.append(Failure(r, rec["time"], f"{rec['type']}: {rec['message']}".rstrip(": "),
                           rec.get("where"), rec.get("step"), _is_consequence(rec), rec.get("save")))
    errored = {f.rank for f in out}
    for r, t in deaths.items():
        code = exit_codes.get(r)
        if r in errored or code == 0:
            continue
        stopped = code in (-signal.SIGTERM, 143, 124)  # stopped by torchrun / our watchdog
        out.append(Failure(r, t, _signal_text(code), consequence=stopped))
    return sorted(out, key=lambda f: f.time)


def summarize(failures: list[Failure], log_dir: Path, world_size: int | None = None) -> list[str]:
    """At most ~6 lines: the first failure (with file:line), then who else ended and where the logs are."""
    if not failures:
        return [f"no rank reported an error; see {log_dir}/rank_N.log and {log_dir}/torchrun.log"]
    primaries = [f for f in failures if not f.consequence] or failures
    first = primaries[0]
    lines = [f"rank {first.rank} failed first{first.when()}: {first.text}"]
    if first.where:
        lines.append(f"  at {first.where}")
    same = sorted({f.rank for f in primaries[1:] if f.text == first.text})
    if same:
        lines.append(f"  the same failure on rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))}")
    others = [f for f in primaries[1:] if f.text != first.text][:2]
    for f in others:
        lines.append(f"  also rank {f.rank}: {f.text}" + (f" at {f.where}" if f.where else ""))
    named = {first.rank, *same, *(f.rank for f in others)}
    rest = sorted({f.rank for f in failures} - named)
    if rest:
        lines.append(f"  then rank{'s' if len(rest) > 1 else ''} {', '.join(map(str, rest))} ended "
                     "(lost a peer, or stopped by the launcher)")
    lines.append(f"  full output of each rank: {log_dir}/rank_N.log")
    return lines
