"""Layout-free checkpoints: sharded save and load through ``torch.distributed.checkpoint``.

Modules:

* ``items``     what gets saved: every tensor as rectangular chunks of its full logical tensor.
* ``planner``   DCP save/load planners over those chunks (resharding = reading overlaps).
* ``safety``    loading without unpickling arbitrary objects; config compatibility.
* ``io``        one-directory save/load, ``save_model_full`` / ``load_model_full`` /
  ``load_model_into``.
* ``rng``       per-rank RNG states, and their deterministic re-derivation after a layout change.
* ``manager``   :class:`~paratron.checkpoint.manager.CheckpointManager`: atomic, rotating,
  optionally asynchronous checkpoints for the training loop.

This package imports nothing on import (see docs/ARCHITECTURE.md).
"""
