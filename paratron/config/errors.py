"""The one exception of configuration problems."""


class ConfigError(ValueError):
    """A configuration value breaks a rule; the message names the field, value and rule."""
