"""What ``paratron plan`` prints and writes: the ranked table, one plan's breakdown, the TOML."""

from __future__ import annotations

from paratron.config import Config, to_toml

from .estimate import Estimate, Problem
from .layout import to_config

GB = 1e9


def table(plans: list[Estimate]) -> str:
    """The ranked plans: layout, step time, tokens/s, MFU, memory per rank, bubble fraction."""
    head = f"{'#':>2}  {'layout':<44} {'step s':>9} {'tokens/s':>11} {'MFU':>6} {'mem/rank GB':>11} {'bubble':>7}"
    rows = [head, "-" * len(head)]
    for i, e in enumerate(plans, 1):
        rows.append(f"{i:>2}  {e.layout.short():<44} {e.step_time:>9.4g} {e.tokens_per_second:>11.4g} "
                    f"{100 * e.mfu:>5.1f}% {e.memory.total / GB:>11.3f} {e.bubble:>7.3f}")
    return "\n".join(rows)


def explain(e: Estimate, prob: Problem) -> str:
    """The breakdown of one plan: where its step time and its memory go."""
    lay = e.layout
    lines = [f"plan: {lay.short()}  ({prob.cluster.world} ranks = tp {lay.tp} x cp {lay.cp} x pp {lay.pp} "
             f"x dp {lay.dp}; {lay.microbatches(prob.global_batch_size)} microbatches of {lay.mbs})",
             f"step time {e.step_time:.4g} s = "]
    for name, v in e.parts.items():
        lines.append(f"  {name:<26} {v:>10.4g} s  ({100 * v / e.step_time:5.1f}%)")
    lines.append(f"bubble fraction {e.bubble:.3f} (mean over pipeline ranks, from the simulator)")
    lines.append(f"throughput {e.tokens_per_second:.4g} tokens/s, {e.tflops_per_device:.4g} model TFLOP/s per "
                 f"device ({e.hw_tflops_per_device:.4g} counting recompute), MFU {100 * e.mfu:.1f}%")
    m = e.memory
    lines.append(f"memory on pipeline rank {e.memory_rank}: {m.total / GB:.3f} GB = params {m.params / GB:.3f} + "
                 f"grads {m.grads / GB:.3f} + optimizer {m.optimizer / GB:.3f} + activations "
                 f"{m.activations / GB:.3f} + transient {m.transient / GB:.3f} "
                 f"(device {prob.cluster.hw.memory_bytes / GB:.3g} GB)")
    return "\n".join(lines)


def plan_toml(base: Config, e: Estimate, prob: Problem, command: str) -> str:
    """The best plan as a config file for ``paratron train``, with how it was made in a comment."""
    cfg = to_config(base, e.layout, prob.global_batch_size, prob.seq_length, prob.precision)
    header = (f"# Written by: {command}\n"
              f"# Plan: {e.layout.short()}; predicted {e.step_time:.4g} s/step, {e.tokens_per_second:.4g} tokens/s, "
              f"MFU {100 * e.mfu:.1f}%, {e.memory.total / GB:.3f} GB per rank.\n"
              f"# Run: paratron train --config THIS_FILE --nproc-per-node {prob.cluster.gpus_per_node}"
              + (f" --nnodes {prob.cluster.nodes} ..." if prob.cluster.nodes > 1 else "") + "\n\n")
    return header + to_toml(cfg)
