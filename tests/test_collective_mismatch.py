"""Collectives that do not match across ranks: found by the stop agreement's fingerprint (the
default) and before every op (``parallel.check_collectives``), named by collective number and
each rank's op; the hang diagnosis compares the ranks' rings the same way.

gloo pairs a float32[4] all-reduce with an int32[4] one, or SUM with MAX, without a word (same
byte count and chunks); an op of another byte count makes gloo abort the rank that receives more
than its buffer holds.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.distributed as dist

from paratron.parallel.flight import FlightRecorder, signature
from paratron.local_ranks import run_ranks
from paratron.launch.hang import diagnose
from test_launcher_failures import ROOT, _command, _env, _no_process_left


def _mismatch(kind: str, exhaustive: bool):
    from paratron.parallel.collcheck import CollectiveMismatch
    from paratron.parallel.context import ParallelContext
    from paratron.training.trainer import agree_to_stop

    ctx = ParallelContext.build()
    fr = FlightRecorder(exhaustive=exhaustive) if exhaustive else FlightRecorder()
    ctx.ledger.flight = fr
    x = torch.ones(4)
    fr.step = 1
    ctx.world.all_reduce(x)  # collective #1, the same everywhere
    agree_to_stop(ctx, False)  # #2: passes
    fr.step = 2
    odd = ctx.rank == 1
    try:
        if kind == "dtype":  # #3: float32[4] against int32[4]
            ctx.world.all_reduce(torch.ones(4, dtype=torch.int32) if odd else x)
        elif kind == "reduce":  # #3: SUM against MAX
            ctx.world.all_reduce(x, op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)
        elif kind == "extra" and odd:  # #3 on rank 1 only: a stray metric before the agreement
            ctx.world.host_all_reduce(torch.ones(1))
        stop = agree_to_stop(ctx, False)
    except CollectiveMismatch as e:
        return str(e)
    return f"no mismatch found (stop={stop})"


@pytest.mark.parametrize("kind,exhaustive,rank0,rank1", [
    ("dtype", False, "all_reduce@world SUM float32 x4", "all_reduce@world SUM int32 x4"),
    ("reduce", False, "all_reduce@world SUM float32 x4", "all_reduce@world MAX float32 x4"),
    ("dtype", True, "all_reduce@world SUM float32 x4", "all_reduce@world SUM int32 x4"),
    ("extra", True, "host_all_reduce@world MAX int64 x5", "host_all_reduce@world SUM float32 x1"),
])
def test_mismatch_is_named_by_number_and_each_ranks_op(kind, exhaustive, rank0, rank1):
    out = run_ranks(_mismatch, 2, kind, exhaustive, timeout=120)
    for text in out:  # every rank stops, with the same diagnosis
        assert text.startswith("collective mismatch at collective #3 of group world (ranks 0,1)"), text
        lines = text.splitlines()
        assert lines[1] == f"  rank 0: #3 {rank0} at step 2", text
        assert lines[2] == f"  rank 1: #3 {rank1} at step 2", text


def test_signature_and_fingerprint():
    assert signature("all_to_all", "ep", None, "bfloat16", [7, 16]) == "all_to_all@ep - bfloat16 [*,16]"
    assert signature("all_reduce", "tp", "SUM", "float32", [2, 3]) == "all_reduce@tp SUM float32 x6"
    a, b = FlightRecorder(), FlightRecorder()
    for fr, dtype in ((a, torch.float32), (b, torch.int32)):
        fr.begin("all_reduce", "tp", (0, 1), torch.ones(3), "SUM")
        fr.begin("send", "pp", (0, 1), torch.ones(3))  # p2p: numbered, but not fingerprinted
        fr.begin("all_reduce", "tp", (0, 1), torch.ones(3, dtype=dtype), "SUM")
    assert a.fingerprints().keys() == {(0, 1)} and a.fingerprints()[(0, 1)][0] == 2
    assert a.fingerprints() != b.fingerprints()
    assert [e.cseq for e in a.entries()] == [1, None, 2] and [e.seq for e in a.entries()] == [1, 2, 3]


def _dump(rank, reason, entries):
    return {"rank": rank, "reason": reason, "time": 10.0, "hang_timeout_s": 5, "counts": {"0,1": 3},
            "entries": entries}


def _entry(cseq, sig, start, end=1.0):
    op, group = sig.split()[0].split("@")
    return {"seq": cseq, "cseq": cseq, "op": op, "group": group, "ranks": [0, 1], "shape": [1],
            "dtype": "float32", "step": 3, "start": start, "end": end, "reduce": None, "sig": sig}


def test_hang_diagnosis_names_the_first_disagreement_not_every_member_entered():
    """Rank 1's extra all-reduce took rank 0's stop agreement (#2); then both wait in #3: every
    member entered the stuck op, and the rings say why."""
    same = _entry(1, "all_reduce@world SUM float32 x4", 1.0)
    dumps = {0: _dump(0, "hang", [same, _entry(2, "host_all_reduce@world MAX int64 x5", 2.0),
                                  _entry(3, "all_reduce@world SUM float32 x4", 3.0, None)]),
             1: _dump(1, "hang", [same, _entry(2, "host_all_reduce@world SUM float32 x1", 2.0),
                                  _entry(3, "host_all_reduce@world MAX int64 x5", 3.0, None)])}
    text = diagnose(dumps, where="R/hang")
    assert text.splitlines()[:3] == [
        "collective mismatch at collective #2 of group world (ranks 0,1): the ranks ran different ops there",
        "  rank 0: #2 host_all_reduce@world MAX int64 x5 at step 3",
        "  rank 1: #2 host_all_reduce@world SUM float32 x1 at step 3"], text
    # Rings that agree leave the hang diagnosis as it was.
    dumps[1]["entries"] = dumps[0]["entries"]
    assert "every member of the stuck ops entered them" in diagnose(dumps)


AGREEMENT = "#17 host_all_reduce@world MAX int64 x5 at step 3"  # the stop agreement of step 3 (2 ranks)
STRAY = "#17 host_all_reduce@world SUM float32 x1 at step 3"


@pytest.mark.parametrize("fault,extra,rank0,rank1", [
    # The case: rank 1's stray all-reduce meets rank 0's stop agreement; gloo aborts rank 1
    # (byte counts differ) and its black box tells what it ran.
    ("extra:1:3", [], AGREEMENT, STRAY),
    pytest.param("redop:1:3", [], "#17 host_all_reduce@world SUM float32 x2 at step 3",
                 "#17 host_all_reduce@world MAX float32 x2 at step 3", marks=pytest.mark.slow),
    pytest.param("extra:1:3", ["parallel.check_collectives=true"], AGREEMENT, STRAY, marks=pytest.mark.slow),
])
def test_a_mismatched_collective_stops_the_job_before_any_save(tiny_corpus, tmp_path, fault, extra, rank0, rank1):
    """Through ``paratron train`` on 2 ranks: one diagnosis naming the collective's number and each
    rank's op, no traceback on the console, and no checkpoint begun (one was due at step 3)."""
    run_dir = tmp_path / "run"
    opts = ["parallel.tensor=1", f"checkpoint.save={run_dir / 'ckpt'}", "checkpoint.interval=3",
            "train.sample_tokens=0"] + extra
    r = subprocess.run(_command(run_dir, tiny_corpus, opts, nproc=2), env=_env(fault), capture_output=True,
                       text=True, timeout=240, cwd=ROOT)
    _no_process_left(run_dir)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("paratron train: collective mismatch"))
    assert lines[at] == ("paratron train: collective mismatch at collective #17 of group world (ranks 0,1): "
                         "the ranks ran different ops there"), out
    assert lines[at + 1:at + 3] == [f"  rank 0: {rank0}", f"  rank 1: {rank1}"], out
    assert "Traceback" not in out
    saved = [p.name for p in (run_dir / "ckpt").glob("*") if not p.name.startswith(".")]
    assert saved == [], f"a save began after the mismatch: {saved}"


def test_black_box_keeps_the_collectives_and_skips_torn_records(tmp_path):
    fr = FlightRecorder(capacity=2, black_box=tmp_path / "rank_0.ring")
    fr.step = 4
    for n in (1, 2, 3):
        fr.begin("all_reduce", "dp", (0, 2), torch.ones(n), "SUM")
    fr.begin("send", "pp", (0, 1), torch.ones(1))  # p2p: not kept
    long = tuple(range(0, 200, 2))  # a group whose ranks text is too long for a record
    fr.begin("all_gather", "world", long, torch.ones(1))
    from paratron.parallel.flight import group_key, read_black_box

    got = read_black_box(tmp_path / "rank_0.ring")  # a ring of 2: the last two collectives
    assert [(e["cseq"], e["step"], e["sig"], e["ranks"]) for e in got] == [
        (3, 4, "all_reduce@dp SUM float32 x3", [0, 2]), (1, 4, "all_gather@world - float32 x1", None)]
    assert got[1]["key"] == group_key(long) and group_key(long).startswith("#")
    data = bytearray((tmp_path / "rank_0.ring").read_bytes())
    data[20] ^= 0xFF  # tear the first record
    (tmp_path / "rank_0.ring").write_bytes(bytes(data))
    assert [e["cseq"] for e in read_black_box(tmp_path / "rank_0.ring")] == [1]


def test_check_collectives_needs_the_flight_recorder():
    from paratron.config import ConfigError
    from paratron.rules import build_config, validate

    validate(build_config(None, ["parallel.check_collectives=true"]), 2)
    with pytest.raises(ConfigError, match="parallel.check_collectives=true needs the hang watchdog"):
        validate(build_config(None, ["parallel.check_collectives=true", "parallel.hang_timeout_s=0"]), 2)
