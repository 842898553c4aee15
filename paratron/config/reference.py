"""The config reference, generated from the dataclasses of :mod:`.sections`.

Each key's type and default come from its dataclass field, its description from the string
literal written under the field (read from the source with :mod:`ast`: Python keeps no such
attribute docstrings at run time), and its Megatron-LM spellings from :mod:`.aliases`. The same
rows feed ``paratron config --list`` (a terminal) and ``docs/config.md`` (Markdown); the order is
that of the dataclasses, so the output is deterministic.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from paratron import markup

from .aliases import MEGATRON_ALIASES, MEGATRON_SWITCHES
from .loading import _toml_value, given_keys, read_toml
from .sections import SECTIONS, Config

MARKDOWN_COMMAND = "paratron config --markdown > docs/config.md"
"""How docs/config.md is regenerated (named in its header and by the test that checks it)."""


@dataclass(frozen=True)
class Key:
    """One config key of the reference."""

    section: str
    name: str
    type: str
    """The field's type as written in a config: ``int``, ``float | none``, ``"a" | "b"``."""
    default: str
    """The default as a TOML value, or ``none``."""
    megatron: tuple[str, ...]
    """Megatron-LM flags that set this key (a switch with the value it sets: ``--bf16 (bf16)``)."""
    doc: str
    """The field's docstring, reST as written (empty when the field has none)."""

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def field_docs(cls: type) -> dict[str, str]:
    """{field name: the string literal right under its annotated assignment} of a dataclass.

    Raises:
        OSError: the class's source cannot be read (a frozen build without ``.py`` files).
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def type_name(tp: Any) -> str:
    """A field type as a config user writes it (``Optional[int]`` is ``int | none``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(_toml_value(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return "none" if value is None else _toml_value(value)


def _megatron_flags() -> dict[str, list[str]]:
    flags: dict[str, list[str]] = {}
    for flag, key in MEGATRON_ALIASES.items():
        flags.setdefault(key, []).append(flag)
    for flag, (key, value) in MEGATRON_SWITCHES.items():
        flags.setdefault(key, []).append(f"{flag} ({value})")
    flags.setdefault("parallel.virtual_pipeline", []).append("--num-layers-per-virtual-pipeline-stage (derived)")
    return flags


def section_classes() -> dict[str, type]:
    """{section name: its dataclass}, in :class:`Config` order."""
    return {name: type(getattr(Config(), name)) for name in SECTIONS}


def keys(section: str | None = None) -> list[Key]:
    """Every key of ``section`` (all sections when None), in dataclass order.

    Raises:
        KeyError: ``section`` is not a config section.
    """
    if section is not None and section not in SECTIONS:
        raise KeyError(f"unknown config section {section!r}: one of {', '.join(SECTIONS)}")
    flags = _megatron_flags()
    out = []
    for name, cls in section_classes().items():
        if section not in (None, name):
            continue
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            dotted = f"{name}.{f.name}"
            out.append(Key(name, f.name, type_name(hints[f.name]), _default(f), tuple(flags.get(dotted, ())),
                           docs.get(f.name, "")))
    return out


def text_reference(section: str | None = None, width: int = 100) -> str:
    """The reference for a terminal: ``[section]``, then per key its type, default, Megatron
    flags and the wrapped description."""
    lines, current = [], None
    for k in keys(section):
        if k.section != current:
            lines += ([""] if lines else []) + [f"[{k.section}]"]
            current = k.section
        head = f"  {k.name}: {k.type} = {k.default}"
        if k.megatron:
            head += f"    (Megatron: {', '.join(k.megatron)})"
        lines.append(head)
        for para in markup.plain(k.doc).split("\n\n"):
            lines += textwrap.wrap(" ".join(para.split()), width, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown_reference() -> str:
    """``docs/config.md``: one table per section (key, type, default, Megatron flag, description)."""
    out = ["# Configuration reference", "",
           f"Generated from `paratron/config/sections.py` by `{MARKDOWN_COMMAND}`; do not edit by hand.",
           "Set a key in a TOML file's `[section]` or with `--set section.key=value`; a Megatron-LM flag",
           "in the last column sets the same key. `none` means the field is unset (see its description).",
           "`paratron config --show CONFIG` prints a resolved config with the defaults marked."]
    current = None
    for k in keys():
        if k.section != current:
            out += ["", f"## [{k.section}]", "", "| key | type | default | Megatron | description |",
                    "|---|---|---|---|---|"]
            current = k.section
        megatron = "<br>".join(f"`{_cell(f)}`" for f in k.megatron)
        out.append(f"| `{k.name}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {megatron} | "
                   f"{_cell(markup.markdown(k.doc))} |")
    return "\n".join(out) + "\n"


def _none_meaning(doc: str) -> str:
    """The sentence of a docstring saying what None means ("None means seq_length."), or ""."""
    text = " ".join(markup.plain(doc).split())
    at = text.find("None")
    return text[at:].split(". ")[0].rstrip(".") if at >= 0 else ""


def resolved_toml(cfg: Config, path: str | None, overrides: list[str]) -> str:
    """``cfg``, the config of ``path`` with ``overrides`` (:func:`paratron.rules.build_config`), as TOML, every key written out and marked:
    nothing for a key the file or an override sets, ``# default`` for a default, ``# implied``
    for a value derived from other keys (a schedule's fixed chunk count, a Megatron alias).
    A key left unset (None) is a comment, as TOML has no null, with what None means.

    Raises:
        ConfigError: a malformed ``path`` (its keys are read again to mark them).
    """
    given = given_keys(read_toml(path), overrides)
    defaults, docs = Config(), {k.dotted: k.doc for k in keys()}
    lines = [f"# paratron config --show: {path or 'the defaults'}" + "".join(f" --set {o}" for o in overrides)]
    for section, values in cfg.to_dict().items():
        lines += ["", f"[{section}]"]
        for name, value in values.items():
            dotted = f"{section}.{name}"
            mark = "" if dotted in given else (
                "default" if value == getattr(getattr(defaults, section), name) else "implied")
            line = f"{name} = {_toml_value(value)}" if value is not None else f"# {name} = none"
            if value is None and _none_meaning(docs[dotted]):
                mark += f": {_none_meaning(docs[dotted])}" if mark else _none_meaning(docs[dotted])
            lines.append(f"{line:<40} # {mark}" if mark else line)
    return "\n".join(lines) + "\n"
