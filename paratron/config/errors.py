"""The one exception of configuration problems (defined in :mod:`paratron.errors`, the base
module every package may import; re-exported here as ``paratron.config.ConfigError``)."""

from paratron.errors import ConfigError

__all__ = ["ConfigError"]
