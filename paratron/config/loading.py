"""TOML files and ``section.key=value`` overrides into a :class:`Config`, typed by each field."""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .errors import ConfigError
from .sections import KEY_ALIASES, SECTIONS, VALUE_ALIASES, Config


# ------------------------------------------------------------------------------------------
def _section_types(section: str) -> dict[str, Any]:
    cls = type(getattr(Config(), section))
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _did_you_mean(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert ``value`` (from TOML or a string override) to the field type ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(key, value, non_none[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} must be one of {', '.join(map(repr, args))}")
        return value
    if origin is list:
        (item,) = args
        if isinstance(value, str):  # "0,2,3,3" or "[a, b]" that TOML did not read (bare words)
            value = [v for v in value.strip().strip("[]").replace(",", " ").split() if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r} must be a list")
        return [_coerce(key, v, item) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be an integer")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be an integer") from None
        if f != int(f):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return int(f)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}={value!r} must be a number") from None
    if tp is str:
        return str(value)
    return value


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set ``section.key`` (or a Megatron-Core name of :data:`~.sections.KEY_ALIASES`) to
    ``value`` (or a Megatron-Core spelling of it, :data:`~.sections.VALUE_ALIASES`), converted to
    the field's type.

    Raises:
        ConfigError: unknown section or key (with a did-you-mean), or a value of the wrong type.
    """
    if "." not in dotted:
        raise ConfigError(f"override {dotted!r} must look like section.key=value, "
                          f"with section one of {', '.join(SECTIONS)}")
    canonical = KEY_ALIASES.get(dotted, dotted)
    if isinstance(value, str):
        value = VALUE_ALIASES.get(canonical, {}).get(value, value)
    section, key = canonical.split(".", 1)
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}{_did_you_mean(section, SECTIONS)}")
    types_ = _section_types(section)
    if key not in types_:
        elsewhere = [f"{s}.{key}" for s in SECTIONS if key in _section_types(s)]
        if elsewhere:  # the right key in the wrong section
            hint = f" (did you mean {elsewhere[0]!r}?)"
        else:
            hint = _did_you_mean(dotted, [f"{section}.{k}" for k in types_]) or _did_you_mean(
                dotted, [f"{s}.{k}" for s in SECTIONS for k in _section_types(s)])
        raise ConfigError(f"unknown config key {dotted!r}{hint}")
    try:
        setattr(getattr(cfg, section), key, _coerce(dotted, value, types_[key]))
    except ConfigError as e:
        spellings = VALUE_ALIASES.get(canonical)
        if not spellings:
            raise
        also = ", ".join(f"{a!r} for {b!r}" for a, b in spellings.items())
        raise ConfigError(f"{e} (Megatron-Core's {also} are accepted too)") from None


def parse_override_value(raw: str) -> Any:
    """The value of one ``--set key=VALUE``, read as TOML where it is a TOML array or string
    (``[2,0,3,3]``, ``["a", "0.5", "b"]``, ``"text"``); anything else stays the raw string, which
    the field's type converts (``4``, ``true``, ``none``, ``0,2,3,3``, ``interleaved``)."""
    text = raw.strip()
    if text[:1] in ("[", '"', "'"):
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            pass
    return text


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply ``["section.key=value", ...]`` in order (values as in :func:`parse_override_value`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        k, v = item.split("=", 1)
        set_value(cfg, k.strip(), parse_override_value(v))
    return cfg


def _override_keys(overrides: list[str]) -> set[str]:
    return {item.split("=", 1)[0].strip() for item in overrides if "=" in item}


def from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    """Build a :class:`Config` from nested dicts (as TOML gives). Unknown keys are errors."""
    cfg = Config()
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown config section [{section}]{_did_you_mean(section, SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: [{section}] must be a table")
        for key, value in values.items():
            try:
                set_value(cfg, f"{section}.{key}", value)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = (), *,
                implied: Callable[[Config, set[str]], None] | None = None) -> Config:
    """Read a TOML file (or the defaults when ``path`` is None) and apply overrides, then
    ``implied(cfg, given)`` (``given``: the dotted keys the file and the overrides set), which
    fills defaults that other packages imply. A run loads through :func:`paratron.rules.load_config`,
    which passes the pipeline schedule's implied chunk count.

    Raises:
        ConfigError: a missing or malformed file, an unknown key, a value of the wrong type.
    """
    data = read_toml(path)
    cfg = from_dict(data, str(path) if path else "<defaults>")
    apply_overrides(cfg, list(overrides))
    if implied is not None:
        implied(cfg, given_keys(data, overrides))
    return cfg


def read_toml(path: str | Path | None) -> dict[str, Any]:
    """The tables of a TOML config file ({} when ``path`` is None).

    Raises:
        ConfigError: a missing or malformed file.
    """
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None


def given_keys(data: dict[str, Any], overrides: list[str]) -> set[str]:
    """The dotted keys a file's tables (``data``) and ``section.key=value`` overrides set."""
    return {f"{section}.{key}" for section, values in data.items() for key in values} | _override_keys(overrides)


def to_toml(cfg: Config) -> str:
    """Render a config as TOML. TOML has no null: a None value is omitted where it is the field's
    default, else written as ``""`` (which loads as None), so it reads back as None."""
    defaults = Config().to_dict()
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            if v is None and defaults[section][k] is None:
                continue
            lines.append(f"{k} = {_toml_value('' if v is None else v)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    # A TOML basic string: JSON's escapes (\n, \t, \uXXXX for other control characters) are
    # TOML's, except that TOML also forbids a raw DEL.
    return json.dumps(str(v), ensure_ascii=False).replace("\x7f", "\\u007f")
