"""Pipeline parallelism: schedules as action lists, their validator and simulator, timelines,
the layer partition and the runtime that executes one rank's list.

Import from the submodules (``paratron.pipeline.registry``, ``.runtime``, ...); this file imports
nothing so that the simulator works without a model.
"""
