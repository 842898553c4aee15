"""The base exception of paratron: a run's configuration breaks a rule.

Every package may raise it (the config loader, the registries, the rules of :mod:`paratron.rules`
and the owners' pure checks), so it lives below all of them and imports nothing.
"""


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the field, value and rule."""
