"""One registry type for everything the config selects by name: pipeline schedules
(``parallel.schedule``), MoE token dispatchers (``model.moe_token_dispatcher``) and transformer
blocks (``model.block``). Plugins add entries at import time (docs/DESIGN.md principle 7).

Registries are the one deliberate kind of module-level mutable state: each default registry is
a module constant that plugins extend.
"""

from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

from paratron.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry, with the config field that selects from it.

    Args:
        kind: what an entry is, for messages (``"schedule"``).
        field: the config field whose value is looked up (``"parallel.schedule"``).
        make: optional ``make(name, *args, **kwargs) -> T`` that builds the stored entry from
            the arguments of :meth:`register` (e.g. a schedule function plus its placement);
            without it the single argument is stored as is.
    """

    def __init__(self, kind: str, field: str, make: Callable[..., T] | None = None) -> None:
        self.kind, self.field = kind, field
        self._make = make
        self._entries: dict[str, T] = {}

    def register(self, name: str, *args, replace: bool = False, **kwargs) -> T:
        """Add an entry and return it.

        Raises:
            ValueError: ``name`` is not a non-empty string, or is taken by another entry
                (unless ``replace``).
        """
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name {name!r} must be a non-empty string")
        if self._make is not None:
            entry = self._make(name, *args, **kwargs)
        elif len(args) == 1 and not kwargs:
            entry = args[0]
        else:
            raise TypeError(f"{self.kind} registry: register(name, entry) takes exactly one entry")
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass replace=True to override it")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name`` if present."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
            ConfigError: unknown name, naming the config field, the closest known name (did you
                mean) and every known name.
        """
        if name not in self._entries:
            close = difflib.get_close_matches(str(name), list(self._entries), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{self.field}={name!r} is not a registered {self.kind}{hint}; "
                              f"known: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
