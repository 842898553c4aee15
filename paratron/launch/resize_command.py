"""``paratron resize RUN_DIR --layout 1,3`` or ``--pipeline 4 [--layout 1,1,1,1]``: ask the job
training in ``RUN_DIR`` to change its ``parallel.pipeline_layout`` (:mod:`paratron.elastic.relayout`) or its
pipeline degree (:mod:`paratron.elastic.regrid`) at its next step boundary, in memory.

The request is checked against the run's ``config.toml`` first (the same rule the job applies),
then dropped as ``RUN_DIR/relayout_request.json``; the job's rank 0 takes it, every rank agrees,
and the job logs the re-layout (or its refusal) on the console. A run directory no live job
holds (its ``.paratron.lock``, :mod:`paratron.launch.runlock`) is refused, so a request never
waits for the next job there; a new job also removes one left behind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from paratron.elastic.relayout import RelayoutRefused, check_request, layout_name, write_request
from paratron.launch.runlock import LOCK_NAME, live_holder
from paratron.rules import load_config


def _degree(text: str) -> int:
    """``--pipeline``'s value: a whole number of stages, at least one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1 (pipeline stages)")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running job")
    parser.add_argument("--layout", default=None,
                        help="transformer layers per pipeline stage, comma separated (e.g. 1,3); with "
                             "--pipeline, default: the even split")
    parser.add_argument("--pipeline", type=_degree, default=None,
                        help="the new pipeline degree (DP x TP fixed: a grow needs free spares, "
                             "train.elastic_spares; a shrink lets the last stages leave)")


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
    if args.layout is None and args.pipeline in (None, cfg.parallel.pipeline):
        print("paratron resize: give --layout, or --pipeline with a new pipeline degree")
        return 2
    try:
        layout = None if args.layout is None else [int(x) for x in args.layout.split(",")]
    except ValueError:
        print(f"paratron resize: --layout {args.layout!r} must be integers separated by commas")
        return 2
    if args.pipeline is not None:
        cfg.parallel.pipeline = args.pipeline  # the job checks the rest (free spares, the world's rules)
    try:
        check_request(cfg, layout)
    except RelayoutRefused as e:
        print(f"paratron resize: {e}")
        return 2
    if live_holder(Path(args.run_dir)) is None:  # a request left for no job would reach the next one
        print(f"paratron resize: no job is running in {args.run_dir} (nothing holds its lock, "
              f"{Path(args.run_dir) / LOCK_NAME}); a request is taken only by a running job")
        return 2
    path = write_request(Path(args.run_dir), layout, args.pipeline)
    print(f"paratron resize: requested parallel.pipeline={cfg.parallel.pipeline} {layout_name(cfg, layout)}; the "
          f"job takes {path} at its next step boundary")
    return 0
