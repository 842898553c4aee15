"""``paratron simulate``: build a schedule, check it, cost it and draw its timeline.

Example::

    paratron simulate --schedule zb-h1 --pipeline 4 --microbatches 8 --output zbh1.png
    paratron simulate --schedule interleaved --pipeline 4 --microbatches 8 --virtual 2 \\
        --cost-f 1 --cost-b 1 --cost-w 1 --latency 0.1 --output plan.json
    paratron simulate --schedule zb-h1 --pipeline 4 --microbatches 8 --comm-f 0.5 --comm-b 0.5 --overlap-fb
    paratron simulate --schedule 1f1b --pipeline 4 --microbatches 8 --encoder-placement optimus \
        --cost-ef 0.8 --cost-eb 1.6 --output optimus.png

The output format follows the file extension: ``.png`` (matplotlib) or ``.json`` (Chrome trace).
``--trace FILE`` writes the Chrome trace-event JSON whatever the name, with the p2p actions, in the
format of a training run's measured ``RUN_DIR/timeline/step_N.json`` (``train.timeline_steps``),
so both open side by side in Perfetto.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace

from .encoder_schedule import PLACEMENTS, place_encoder
from .registry import SCHEDULES, build_schedule, default_microbatches
from .simulator import Costs, simulate
from .timeline import draw_png, from_spans, write_chrome_trace
from .validate import validate
from .overlap import overlap_fb


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", default="1f1b",
                        help=f"registered schedule name ({', '.join(SCHEDULES.names())})")
    parser.add_argument("--pipeline", type=int, required=True, help="pipeline-parallel size p")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches m (default 2p)")
    parser.add_argument("--virtual", type=int, default=None,
                        help="virtual stages (model chunks) per rank v (default 2 for interleaved and the V schedules zbv/dualpipev, else 1)")
    parser.add_argument("--cost-f", type=float, default=1.0, help="forward cost of one chunk")
    parser.add_argument("--cost-b", type=float, default=1.0, help="input-grad backward (B) cost")
    parser.add_argument("--cost-w", type=float, default=1.0, help="weight-grad backward (W) cost; BW = B + W")
    parser.add_argument("--latency", type=float, default=0.0, help="p2p latency, in the same unit")
    parser.add_argument("--link-latency", default=None,
                        help="extra latency per link between ranks k and k+1, comma-separated (p-1 values, same "
                             "unit); 1f1b-delay takes its warm-ups from it")
    parser.add_argument("--comm-f", type=float, default=0.0,
                        help="MoE all-to-all time inside each forward (part of --cost-f)")
    parser.add_argument("--comm-b", type=float, default=0.0,
                        help="MoE all-to-all time inside each backward (part of --cost-b)")
    parser.add_argument("--overlap-fb", action="store_true",
                        help="pair forwards and backwards of different microbatches (FB, pipeline.overlap) "
                             "and print the plain schedule's makespan for comparison")
    parser.add_argument("--encoder-placement", choices=PLACEMENTS, default=None,
                        help="add a multimodal encoder's work (docs/optimus.md): on stage 0's rank (stage0) or "
                             "in the bubbles of every rank (optimus, which also prints stage0's makespan)")
    # None = not given: the encoder flags only mean something with --encoder-placement, and a
    # value given without it must be refused rather than silently simulate a model with no encoder.
    parser.add_argument("--cost-ef", type=float, default=None,
                        help="encoder forward cost of one microbatch (with --encoder-placement; default 0)")
    parser.add_argument("--cost-eb", type=float, default=None,
                        help="encoder backward cost of one microbatch (with --encoder-placement; default 0)")
    parser.add_argument("--encoder-parts", type=int, default=None,
                        help="parts per microbatch, each placed on one rank (optimus; default 1)")
    parser.add_argument("--output", default=None, help="timeline file: .png or .json (Chrome trace)")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write the simulated timeline, p2p included, as Chrome trace-event JSON (the "
                             "format of a training run's RUN_DIR/timeline/step_N.json)")


def _checked_costs(args: argparse.Namespace, p: int) -> tuple[float, ...] | None:
    """The per-link latencies of ``--link-latency`` (None when not given), after checking that
    every cost is a finite number >= 0: a NaN, an infinity or a negative time would give a
    meaningless makespan (or a traceback in 1f1b-delay's warm-up count).

    Raises:
        ValueError: naming the flag and the rule.
    """
    for flag in ("cost_f", "cost_b", "cost_w", "latency", "comm_f", "comm_b"):
        v = getattr(args, flag)
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{flag.replace('_', '-')}={v} must be a finite number >= 0")
    for comm, cost in (("comm_f", "cost_f"), ("comm_b", "cost_b")):
        if getattr(args, comm) > getattr(args, cost):
            # the all-to-all time is a part of the action's time (Costs.comm_F), not an addition
            raise ValueError(f"--{comm.replace('_', '-')}={getattr(args, comm)} is part of "
                             f"--{cost.replace('_', '-')}={getattr(args, cost)} and cannot exceed it")
    encoder_flags = [f for f in ("cost_ef", "cost_eb", "encoder_parts") if getattr(args, f) is not None]
    if encoder_flags and not args.encoder_placement:
        raise ValueError(f"--{encoder_flags[0].replace('_', '-')} costs a multimodal encoder and needs "
                         "--encoder-placement stage0|optimus")
    if args.encoder_parts is not None and args.encoder_placement != "optimus":
        raise ValueError("--encoder-parts splits each microbatch's encoder work over the ranks' bubbles, "
                         "which only --encoder-placement optimus does")
    if args.link_latency is None:
        return None
    rule = f"--link-latency={args.link_latency!r} must give p-1={p - 1} comma-separated finite values >= 0"
    try:
        links = tuple(float(x) for x in args.link_latency.split(","))
    except ValueError:
        raise ValueError(rule) from None
    if len(links) != p - 1 or not all(math.isfinite(x) and x >= 0 for x in links):
        raise ValueError(rule)
    return links


def run(args: argparse.Namespace) -> int:
    p = args.pipeline
    m = args.microbatches if args.microbatches is not None else default_microbatches(p)
    try:
        fixed = SCHEDULES.get(args.schedule).virtual_stages  # zbv, dualpipev: 2
        v = args.virtual if args.virtual is not None else fixed or (2 if args.schedule == "interleaved" else 1)
        links = _checked_costs(args, p)
        options = {}
        if args.schedule == "1f1b-delay" and links is not None:
            options = {"link_latency": links, "microbatch_time": args.cost_f + args.cost_b + args.cost_w}
        schedule = build_schedule(args.schedule, p, m, v, **options)
        validate(schedule, m)
    except ValueError as e:
        print(f"paratron simulate: {e}", file=sys.stderr)
        return 2
    costs = Costs(F=args.cost_f, B=args.cost_b, W=args.cost_w, latency=args.latency, link_latency=links,
                  comm_F=args.comm_f, comm_B=args.comm_b)
    if args.overlap_fb:
        print(f"without FB pairs: makespan {simulate(schedule, costs).makespan:.6g}")
        schedule = overlap_fb(schedule, costs)
        print(f"FB pairs: {sum(a.kind == 'FB' for acts in schedule for a in acts)}")
    if args.encoder_placement:
        try:
            schedule, costs = _with_encoder(args, schedule, costs, m)
        except ValueError as e:
            print(f"paratron simulate: {e}", file=sys.stderr)
            return 2
    result = simulate(schedule, costs)
    print(f"schedule {args.schedule}: p={p} m={m} v={v}")
    print(result.summary())
    planned = from_spans(result.spans, compute_only=False)  # with the p2p, as a measured step's timeline
    if args.trace and _write("--trace", args.trace, lambda path: write_chrome_trace(planned, path)):
        return 2
    if args.output:
        events = from_spans(result.spans)
        if args.output.endswith(".json"):
            def write(path):
                write_chrome_trace(events, path)
        elif args.output.endswith(".png"):
            def write(path):
                draw_png(events, path, title=f"{args.schedule} p={p} m={m} v={v}", unit="cost units")
        else:
            print(f"paratron simulate: --output={args.output!r} must end in .png or .json", file=sys.stderr)
            return 2
        if _write("--output", args.output, write):
            return 2
    return 0


def _with_encoder(args: argparse.Namespace, schedule, costs: Costs, m: int):
    """The schedule with ``--encoder-placement``'s encoder actions, checked, and the costs with
    the encoder's; under optimus, prints the stage0 placement's makespan first.

    Raises:
        ValueError: a negative or non-finite encoder cost, or what ``place_encoder`` raises.
    """
    ef, eb = (0.0 if v is None else v for v in (args.cost_ef, args.cost_eb))
    for flag, v in (("cost_ef", ef), ("cost_eb", eb)):
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--{flag.replace('_', '-')}={v} must be a finite number >= 0")
    parts = 1 if args.encoder_parts is None else args.encoder_parts
    costs = replace(costs, EF=ef, EB=eb, encoder_parts=parts)
    if args.encoder_placement == "optimus":
        base = simulate(place_encoder(schedule, "stage0", costs), costs).makespan
        print(f"encoder on stage 0: makespan {base:.6g}")
    schedule = place_encoder(schedule, args.encoder_placement, costs)
    validate(schedule, m)
    return schedule, costs


def _write(flag: str, path: str, write) -> bool:
    """``write(path)``; False when it worked (and says so), True after printing why not."""
    try:
        write(path)
    except OSError as e:
        print(f"paratron simulate: cannot write {flag}: {e}", file=sys.stderr)
        return True
    print(f"wrote {path}")
    return False
