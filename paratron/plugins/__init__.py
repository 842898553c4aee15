"""Training-loop plugins shipped with paratron, each built on public extension points only
(:mod:`paratron.training.callbacks`); enable one with ``train.callbacks = ["paratron.plugins.X:Class"]``."""
