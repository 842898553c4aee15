"""The reST markup of paratron's docstrings, rendered for a terminal or for Markdown.

Docstrings double as ``--help`` texts and as the config reference (:mod:`paratron.config.reference`),
so the few constructs they use are converted here, once:

* ``literal`` (double backticks): plain ``literal`` on a terminal, single backticks in Markdown;
* :role:`target` (``:func:``, ``:mod:``, ``:class:``, ``:data:``, ...): the target, or its last
  dotted part with a leading ``~``, or the title of ``title <target>``; code in Markdown;
* a paragraph ending in ``::`` (a literal block follows): one colon.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`([^`]+)`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)
_BLOCK = re.compile(r"(\S)::(?=\s*$)", re.MULTILINE)
_BARE_BLOCK = re.compile(r"^(\s*)::\s*$", re.MULTILINE)


def _role_text(target: str) -> str:
    titled = re.fullmatch(r"(.+?)\s*<(.+)>", target, re.DOTALL)
    if titled:
        return titled.group(1)
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target


def _render(text: str, code) -> str:
    text = _ROLE.sub(lambda m: code(_role_text(m.group(1))), text)
    text = _LITERAL.sub(lambda m: code(m.group(1)), text)
    text = _BARE_BLOCK.sub("", text)
    return _BLOCK.sub(r"\1:", text)


def plain(text: str) -> str:
    """``text`` without reST markup, for a terminal (``--help``, ``paratron config --list``)."""
    return _render(text, lambda s: s)


def markdown(text: str) -> str:
    """``text`` with its reST literals and roles as Markdown code spans (``docs/config.md``)."""
    return _render(text, lambda s: f"`{s}`")
