"""``paratron resize RUN_DIR --layout 1,3``: ask the job training in ``RUN_DIR`` to change its
``parallel.pipeline_layout`` at its next step boundary, in memory (:mod:`.relayout`).

The request is checked against the run's ``config.toml`` first (the same rule the job applies),
then dropped as ``RUN_DIR/relayout_request.json``; the job's rank 0 takes it, every rank agrees,
and the job logs the re-layout (or its refusal) on the console.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paratron.elastic.relayout import RelayoutRefused, check_request, write_request
from paratron.rules import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running job")
    parser.add_argument("--layout", required=True,
                        help="transformer layers per pipeline stage, comma separated (e.g. 1,3)")
    parser.add_argument("--pipeline", type=int, default=None,
                        help="the pipeline degree; only the job's current one is supported online")


def run(args) -> int:
    config = Path(args.run_dir) / "config.toml"
    if not config.is_file():
        print(f"paratron resize: {config} does not exist (is {args.run_dir} the run directory of a job?)")
        return 2
    cfg = load_config(str(config), [])
    if not cfg.train.elastic_relayout:
        print(f"paratron resize: {config} has train.elastic_relayout=false: the job takes no re-layout "
              "requests (start it with --set train.elastic_relayout=true)")
        return 2
    try:
        layout = [int(x) for x in args.layout.split(",")]
    except ValueError:
        print(f"paratron resize: --layout {args.layout!r} must be integers separated by commas")
        return 2
    if args.pipeline is not None and args.pipeline != cfg.parallel.pipeline:
        print(f"paratron resize: --pipeline {args.pipeline}: changing the pipeline degree of a running job "
              f"(now parallel.pipeline={cfg.parallel.pipeline}) is not supported yet; only the layout moves")
        return 2
    try:
        check_request(cfg, layout)
    except RelayoutRefused as e:
        print(f"paratron resize: {e}")
        return 2
    path = write_request(Path(args.run_dir), layout)
    print(f"paratron resize: requested parallel.pipeline_layout={layout}; the job takes {path} at its next "
          "step boundary")
    return 0
