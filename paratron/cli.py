"""The ``paratron`` command and its subcommands (:data:`COMMANDS`).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this file only maps names to modules and imports the chosen one, so that ``paratron --help``
stays fast and one broken subcommand cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from paratron import markup

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("paratron.launch.command", "train a model (under torchrun, or --nproc-per-node N)"),
    "preprocess": ("paratron.data.preprocess", "tokenize a JSONL/text corpus into .bin/.idx files"),
    "generate": ("paratron.training.generate", "sample text from a checkpoint"),
    "convert": ("paratron.convert", "convert checkpoints to and from Hugging Face"),
    "simulate": ("paratron.pipeline.simulate_command", "simulate and draw a pipeline schedule"),
    "info": ("paratron.launch.info", "show the process groups of a layout (under torchrun too)"),
    "plan": ("paratron.dryrun.plan_command", "rank parallel layouts with a cost model; write the best as a config"),
    "config": ("paratron.rules.command", "list every config key, or show a config as resolved"),
    "resize": ("paratron.launch.resize_command", "change a running job's pipeline layout at its next step"),
    "dryrun": ("paratron.dryrun.command", "rehearse one step of a layout's ranks on one CPU (fake backend, meta tensors)"),
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's layout, with the reST markup of the docstrings used as help texts removed
    (``paratron --help`` prints ``paratron``, not the double backticks)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(markup.plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return markup.plain(super()._expand_help(action))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="paratron", description=f"The paratron command: {' | '.join(COMMANDS)}.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv[:1])
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"paratron {name}: not available in this version ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    cmd_parser = argparse.ArgumentParser(prog=f"paratron {name}", description=COMMANDS[name][1],
                                         formatter_class=HelpFormatter)
    module.add_arguments(cmd_parser)
    if hasattr(module, "parse"):
        args = module.parse(cmd_parser, argv[1:])
    else:
        args = cmd_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:
        # the reader went away (``paratron simulate | head``): stop quietly, the Unix way, and
        # point stdout at /dev/null so that the interpreter's last flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command a pipe ended


if __name__ == "__main__":
    sys.exit(main())
