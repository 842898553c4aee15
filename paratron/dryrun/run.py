"""Dry-run a layout: choose the ranks that differ, rehearse each, check them against a memory limit.

Ranks of a layout differ only in a few ways: which pipeline stage they hold (the first has the
embedding, the last the head and loss, the middle only layers; under a tied embedding both ends
hold a copy), and where they sit along TP, DP, EP (the last DP / EP rank gets the padding of an
uneven ZeRO shard or expert split). :func:`auto_ranks` picks one rank per such kind, so a
3,072-rank layout is rehearsed in a handful of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paratron.dryrun.predict import compare, predict
from paratron.dryrun.rehearse import DryRunError, rehearse_rank
from paratron.parallel.grid import build_grid
from paratron.planner.pipeline import ScheduleCache
from paratron.progress import progress_bar

from paratron.dryrun.rehearse import GB


def grid_of(cfg, world_size: int):
    p = cfg.parallel
    return build_grid(world_size, tp=p.tensor, cp=p.context, ep=p.expert, pp=p.pipeline,
                      expert_tp=p.expert_tensor, order=p.order)


def auto_ranks(cfg, world_size: int) -> list[int]:
    """The ranks that differ: the first, middle and last pipeline stage at the first position of
    every other axis, and the last TP / DP / EP position of the first and last stage."""
    grid = grid_of(cfg, world_size)
    pp = grid.groups["pp"][0]  # stage s of the pipeline through rank 0
    stages = sorted({0, len(pp) // 2, len(pp) - 1})
    chosen = [pp[s] for s in stages]
    corner = max(range(world_size), key=lambda r: (grid.coords(r)["pp"] == 0, sum(grid.coords(r).values())))
    far = grid.group_of("pp", corner)
    chosen += [far[0], far[-1]]
    return sorted(set(chosen))


def parse_ranks(spec: str, cfg, world_size: int) -> list[int]:
    """``"auto"`` or ``"R,R,..."`` (each ``0 <= R < world_size``).

    Raises:
        DryRunError: a rank out of range or not an integer.
    """
    if spec == "auto":
        return auto_ranks(cfg, world_size)
    try:
        ranks = sorted({int(r) for r in spec.split(",") if r.strip()})
    except ValueError:
        raise DryRunError(f"--ranks={spec!r} must be 'auto' or comma-separated integers") from None
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad or not ranks:
        raise DryRunError(f"--ranks={spec!r}: ranks must lie in 0..{world_size - 1}")
    return ranks


@dataclass
class DryRunReport:
    """Every rehearsed rank's figures (:class:`~.measure.StepMeasure` dicts, with ``predicted``:
    the planner's bytes for the same rank)."""

    world_size: int
    ranks: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"world_size": self.world_size, "ranks": self.ranks}


def dry_run(cfg, world_size: int, ranks: list[int], memory_gb: float | None = None,
            quiet: bool = False) -> DryRunReport:
    """Rehearse ``ranks`` of ``cfg`` at ``world_size`` ranks, one after the other in this process,
    with the planner's prediction beside each; stop at the first rank that fails or does not fit.

    Raises:
        DryRunError: naming the rank (and the layer or term) that would fail at launch.
    """
    report = DryRunReport(world_size)
    grid, cache = grid_of(cfg, world_size), ScheduleCache()
    with progress_bar(len(ranks), "dry run", quiet=quiet, unit="rank") as bar:
        for r in ranks:
            row = rehearse_rank(cfg, world_size, r, memory_gb)
            pred = predict(cfg, world_size, grid.coords(r)["pp"], cache)
            row["predicted"] = pred
            row["vs_planner"] = [list(c) for c in compare(row, pred)]
            report.ranks.append(row)
            bar.update(1)
    return report


def table(report: DryRunReport) -> str:
    """One block per rank: each term's dry-run bytes, planner bytes and ratio; the peak's
    microbatch; ledger bytes per op and group; the distinct p2p message shapes."""
    lines = []
    for row in report.ranks:
        c = row["coords"]
        at = row["peak_at"]
        lines.append(f"rank {row['rank']}  (tp {c['tp']} cp {c['cp']} dp {c['dp']} pp {c['pp']} ep {c['ep']})")
        lines.append(f"  {'term':<14}{'dry run GB':>12}{'planner GB':>12}{'ratio':>8}")
        for term, dry, want, ratio in row["vs_planner"]:
            lines.append(f"  {term:<14}{dry / GB:>12.4f}{want / GB:>12.4f}"
                         f"{(f'{ratio:.3f}' if ratio is not None else '-'):>8}")
        lines.append(f"  peak activations set by microbatch {at[0]} of stage {at[1]}" if at else
                     "  no activations saved")
        for key, e in row["ledger"].items():
            lines.append(f"  {key:<28}{e['calls']:>6} calls {e['bytes']:>16,} B")
        shapes = sorted({(op, tuple(s), d) for op, _, s, d in row["p2p"]})
        for op, s, d in shapes:
            n = sum(1 for o, _, s2, d2 in row["p2p"] if o == op and tuple(s2) == s and d2 == d)
            lines.append(f"  p2p {op} {list(s)} {d} x{n}")
    return "\n".join(lines)
