"""Fault injection for the launcher tests, as a training-loop plugin (``train.callbacks``).

``PARATRON_TEST_FAULT=KIND:RANK:STEP`` picks the fault, on global rank RANK at step STEP:

* ``raise``: raise ``RuntimeError`` at the start of the step;
* ``kill``: SIGKILL this rank at the start of the step;
* ``skip``: after the step's update, skip this rank's next ``ctx.world.host_all_reduce`` (the
  stop-agreement all-reduce that ends every step), so that its peers wait in it for ever.
"""

import os
import signal

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
