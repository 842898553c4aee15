"""``paratron config``: the config reference, and a config as paratron resolves it.

Usage::

    paratron config --list [SECTION]        # every key: type, default, Megatron flag, description
    paratron config --markdown > docs/config.md
    paratron config --show CONFIG [--set section.key=value ...]

The reference is generated from the dataclasses (:mod:`paratron.config.reference`); ``--show``
resolves it as a run does (:func:`paratron.rules.build_config`).
"""

from __future__ import annotations

import argparse
import sys

from paratron.config.reference import markdown_reference, resolved_toml, text_reference
from paratron.config.sections import SECTIONS
from paratron.errors import ConfigError

from . import build_config

DEFAULTS = ""
"""``--show`` without a file: the defaults."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", nargs="?", const="", default=None, metavar="SECTION",
                      help=f"print every key (of SECTION: {', '.join(SECTIONS)}) with its type, default, "
                           "Megatron flag and description")
    what.add_argument("--markdown", action="store_true", help="print the reference as Markdown (docs/config.md)")
    what.add_argument("--show", nargs="?", const=DEFAULTS, default=None, metavar="CONFIG",
                      help="print CONFIG (default: the defaults) resolved, every key written out, "
                           "defaults and implied values marked")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="with --show: override a config key (repeatable)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.list is not None:
            sys.stdout.write(text_reference(args.list or None))
        elif args.markdown:
            sys.stdout.write(markdown_reference())
        else:
            path = args.show or None
            sys.stdout.write(resolved_toml(build_config(path, args.overrides), path, args.overrides))
    except KeyError as e:
        print(f"paratron config: {e.args[0]}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"paratron config: {e}", file=sys.stderr)
        return 2
    return 0
