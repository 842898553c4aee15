"""Example plugin: a per-rank step-time report that names the slowest rank.

Enable it with ``--set train.callbacks=examples/plugins/slowest_rank.py:SlowestRankReport``.
Every ``report_interval`` steps each rank contributes its mean step time; rank 0 prints
``slowest rank R: X s/step (fastest Y s/step, spread Z%)`` and writes
``RUN_DIR/slowest_rank.jsonl``. This is the seed of a fail-slow detector: the collective is one
all-gather of a float per rank, issued by every rank at the same step.
"""

from __future__ import annotations

import json

import torch

from paratron.training.callbacks import Callback, TrainState


class SlowestRankReport(Callback):
    report_interval = 5

    def __init__(self, state: TrainState):
        self.times: list[float] = []

    def on_step_end(self, state: TrainState, metrics: dict, timings: dict[str, float]) -> None:
        # The forward/backward phase, not the step total, which is equal on all ranks once they
        # synchronise at the optimizer step.
        self.times.append(timings["forward_backward"])
        if state.iteration % self.report_interval:
            return
        mine = torch.tensor([[sum(self.times) / len(self.times)]], dtype=torch.float64)
        every = state.ctx.world.all_gather(mine).flatten().tolist()
        self.times.clear()
        if state.ctx.rank != 0:
            return
        slow = max(range(len(every)), key=every.__getitem__)
        fast = min(every)
        line = {"iteration": state.iteration, "slowest_rank": slow, "seconds_per_step": every}
        print(f"[slowest-rank] iteration {state.iteration}: slowest rank {slow}: {every[slow]:.4f} s/step "
              f"(fastest {fast:.4f} s/step, spread {100 * (every[slow] / fast - 1):.0f}%)", flush=True)
        if state.run_dir is not None:
            with open(state.run_dir / "slowest_rank.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
