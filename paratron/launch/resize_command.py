"""``paratron resize RUN_DIR --layout 1,3`` or ``--pipeline 4 [--layout 1,1,1,1]``: ask the job
training in ``RUN_DIR`` to change its ``parallel.pipeline_layout`` (:mod:`paratron.elastic.relayout`) or its
pipeline degree (:mod:`paratron.elastic.regrid`) at its next step boundary, in memory.

The request is checked against the run's ``config.toml`` first (the same rule the job applies),
then dropped as ``RUN_DIR/relayout_request.json``; the job's rank 0 takes it, every rank agrees,
and the job logs the re-layout (or its refusal) on the console and answers in
``RUN_DIR/relayout_answer.json``. The command waits for that answer (``--wait`` seconds) and
exits 0 when the change was applied, 1 when the job refused it (a grow with no free spare, say),
3 when no answer came in time (the request stays queued), 2 for a request refused before it was
sent. A run directory no live job
holds (its ``.paratron.lock``, :mod:`paratron.launch.runlock`) is refused, so a request never
waits for the next job there; a new job also removes one left behind.
"""

from __future__ import annotations

import argparse
import time
import uuid
from pathlib import Path

from paratron.elastic.relayout import RelayoutRefused, check_request, layout_name, read_answer, write_request
from paratron.launch.runlock import LOCK_NAME, live_holder
from paratron.rules import load_config


def _at_least(kind: type, minimum: float, unit: str):
    """An argparse type: a ``kind`` (int or float) of at least ``minimum``, named by ``unit``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value:g} must be >= {minimum:g} ({unit})")
        return value
    return parse


_degree = _at_least(int, 1, "pipeline stages")
_seconds = _at_least(float, 0, "seconds; 0: do not wait")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory of the running job")
    parser.add_argument("--layout", default=None,
                        help="transformer layers per pipeline stage, comma separated (e.g. 1,3); with "
                             "--pipeline, default: the even split")
    parser.add_argument("--pipeline", type=_degree, default=None,
                        help="the new pipeline degree (DP x TP fixed: a grow needs free spares, "
                             "train.elastic_spares; a shrink lets the last stages leave)")
    parser.add_argument("--wait", type=_seconds, default=600.0, metavar="S",
                        help="seconds to wait for the job's answer (0: send the request and return)")


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line, with ``--layout -1,5`` read as ``--layout=-1,5``: argparse takes a value
    that starts with ``-`` and is not one number for an option ("expected one argument"), where
    the layout rule's own message names what is wrong."""
    joined, i = [], 0
    while i < len(argv):
        if argv[i] == "--layout" and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1][1:2].isdigit():
            joined.append(f"--layout={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    return parser.parse_args(joined)


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
    request_id = uuid.uuid4().hex
    try:
        path = write_request(Path(args.run_dir), layout, args.pipeline, request_id)
    except RelayoutRefused as e:
        print(f"paratron resize: {e}")
        return 2
    print(f"paratron resize: requested parallel.pipeline={cfg.parallel.pipeline} {layout_name(cfg, layout)}; the "
          f"job takes {path} at its next step boundary", flush=True)
    return _await_answer(Path(args.run_dir), request_id, args.wait)


def _await_answer(run_dir: Path, request_id: str, wait_s: float) -> int:
    """0 applied, 1 refused by the job (or the job ended first), 3 no answer within ``wait_s``."""
    if wait_s <= 0:
        return 0
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        answer = read_answer(run_dir, request_id)
        if answer is not None:
            print(f"paratron resize: {answer['outcome']} by the job: {answer['message']}")
            return 0 if answer["outcome"] == "applied" else 1
        if live_holder(run_dir) is None:
            print(f"paratron resize: the job in {run_dir} ended before it answered the request")
            return 1
        time.sleep(0.2)
    print(f"paratron resize: no answer from the job within {wait_s:g} s; the request stays queued for its "
          "next step boundary")
    return 3
