"""A lower bound on a layout's step time from its per-stage seconds alone (no action lists).

The search (:mod:`.search`) simulates layouts in order of this bound and stops at the first bound
above the k-th best simulated step time. That is exact (the top k are those of simulating every
layout) because no action list the validator accepts can run faster than the bound: it uses only
what every such list must do (:func:`paratron.pipeline.validate.validate` proves these rules, and
:func:`paratron.pipeline.validate.execute`, the simulator, times them):

* a rank runs one action at a time, and it runs one F, one B and one W (or one BW) of every
  (microbatch, stage) it holds;
* F(j, s) starts after F(j, s-1) has ended, plus the p2p latency when the two stages sit on
  different ranks (its RECV_F waits for a send posted after that F); the backward of (j, s) after
  the backward of (j, s+1) likewise; W(j, s) after B(j, s), on the same rank.

For each pipeline rank ``r``, let ``head_r`` be the earliest its first action can start: one
microbatch's forward through every stage before the first stage ``r`` holds. Then

1. ``r``'s last action ends at least ``head_r + busy_r`` (all its F, B, W seconds);
2. ``r``'s last backward ends at least ``head_r + (all its F and B seconds)`` (each F precedes its
   own backward), and that microbatch's backward then still crosses every lower stage and ends with
   stage 0's W: at least the smallest such chain over the stages ``r`` holds.

The makespan is at least the largest of these over ranks. When ranks share cores
(``sharing`` > 1, :func:`.pipeline.makespan`) the simulation runs at ``works / sharing`` with the
latency unchanged and the step is at least that simulation's makespan and the mean busy time at
the shared speed: the bound takes the same two terms.
"""

from __future__ import annotations

from .compute import Work


def pipeline_floor(works: list[Work], ranks: list[int], m: int, p2p: float, sharing: float = 1.0) -> float:
    """Seconds no schedule of ``m`` microbatches can beat (module docstring).

    Args:
        works: seconds of one microbatch through each virtual stage, in model order, with every
            rank computing at once.
        ranks: the pipeline rank of each virtual stage.
        m: microbatches per step.
        p2p: latency of one stage-boundary message (seconds).
        sharing: the lone-rank speed-up of ranks sharing cores (1 on GPUs).
    """
    w = [x.scaled(1.0 / sharing) for x in works]
    p = max(ranks) + 1
    fwd_in, bwd_out = [0.0] * len(w), [0.0] * len(w)  # forward reaching s; backward left after s
    for s in range(1, len(w)):
        hop = p2p if ranks[s] != ranks[s - 1] else 0.0
        fwd_in[s] = fwd_in[s - 1] + w[s - 1].F + hop
        bwd_out[s] = bwd_out[s - 1] + w[s - 1].B + hop
    head, tail = [float("inf")] * p, [float("inf")] * p
    busy, fb = [0.0] * p, [0.0] * p
    for s, (r, x) in enumerate(zip(ranks, w)):
        head[r] = min(head[r], fwd_in[s])
        tail[r] = min(tail[r], bwd_out[s] + w[0].W)
        busy[r] += m * (x.F + x.B + x.W)
        fb[r] += m * (x.F + x.B)
    critical = max(head[r] + max(busy[r], fb[r] + tail[r]) for r in range(p))
    return max(critical, sharing * sum(busy) / p)
