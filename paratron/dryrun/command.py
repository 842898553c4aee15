"""``paratron dryrun``: rehearse a layout's ranks on one CPU before any GPU is rented.

Usage::

    paratron dryrun --config FILE --world-size N [--ranks auto|R,R,...] [--set KEY=VALUE ...]
                    [--memory-gb G] [--json FILE]

Exit 0 with a table per rank (and ``--json``), or 2 with one line naming the rank and what would
fail at launch (config rule, shape, group, schedule, memory); no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paratron.config import ConfigError
from paratron.rules import build_config, validate

from .plan_command import model_with_vocab
from paratron.dryrun.rehearse import DryRunError
from paratron.dryrun.run import dry_run, parse_ranks, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key (repeatable)")
    p.add_argument("--world-size", type=int, required=True, help="ranks of the layout to rehearse")
    p.add_argument("--ranks", default="auto", help="'auto' (the ranks that differ) or R,R,...")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="refuse a rank whose model states + peak activations exceed this (GB, 1e9 bytes)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every rank's figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def load_config(path: str | None, overrides: list[str], world_size: int):
    """Config from file + overrides, validated for ``world_size``; the vocabulary defaults to the
    tokenizer's configured size (no corpus is read)."""
    cfg = build_config(path, overrides)
    if cfg.model.vocab_size is None:
        cfg.model = model_with_vocab(cfg)
    validate(cfg, world_size)
    return cfg


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides, args.world_size)
        ranks = parse_ranks(args.ranks, cfg, args.world_size)
        report = dry_run(cfg, args.world_size, ranks, args.memory_gb, quiet=args.quiet)
    except (ConfigError, DryRunError, ValueError) as e:
        print(f"paratron dryrun: {e}", file=sys.stderr)
        return 2
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=1), encoding="utf-8")
    return 0
