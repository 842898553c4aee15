"""Fault injection for the launcher tests, as a training-loop plugin (``train.callbacks``).

``PARATRON_TEST_FAULT=KIND:RANK:STEP`` picks the fault, on global rank RANK at step STEP:

* ``raise``: raise ``RuntimeError`` at the start of the step;
* ``kill``: SIGKILL this rank at the start of the step;
* ``skip``: after the step's update, skip this rank's next ``ctx.world.host_all_reduce`` (the
  stop-agreement all-reduce that ends every step), so that its peers wait in it for ever;
* ``redop``: after the step's update, every rank all-reduces a metric over the world, this rank
  with MAX where the others use SUM (gloo pairs them without a word);
* ``extra``: after the step's update, this rank alone issues an extra host all-reduce of one
  float (as a stray metric would), just before the stop agreement.
"""

import os
import signal

import torch
import torch.distributed as dist

from paratron.training.callbacks import Callback


class Fault(Callback):
    def __init__(self, state):
        kind, rank, step = os.environ.get("PARATRON_TEST_FAULT", "none:-1:-1").split(":")
        self.kind, self.rank, self.step = kind, int(rank), int(step)
        self.armed = state.ctx.rank == self.rank

    def on_step_start(self, state):
        if not self.armed or state.iteration + 1 != self.step:
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, state, metrics, timings):
        if self.armed and self.kind == "skip" and state.iteration == self.step:
            world = state.ctx.world

            def skip_once(t, *args, **kwargs):
                del world.host_all_reduce  # back to the class method
                return None

            world.host_all_reduce = skip_once
        if self.kind == "redop" and state.iteration == self.step:
            op = dist.ReduceOp.MAX if self.armed else dist.ReduceOp.SUM
            state.ctx.world.host_all_reduce(torch.ones(2), op=op)
        if self.armed and self.kind == "extra" and state.iteration == self.step:
            state.ctx.world.host_all_reduce(torch.ones(1))
