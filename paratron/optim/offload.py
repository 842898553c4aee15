"""Optimizer CPU offload (``optimizer.cpu_offload``, ``optimizer.offload_fraction``): the fp32
main weights and the optimizer state of some owned ranges live in host memory (pinned on CUDA) and
are stepped there, as in ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing
Billion-Scale Model Training", section 4) and Megatron's ``--optimizer-cpu-offload``.

The device keeps the params and the main grads (the norm, the clipping and the non-finite check
read them there, so the step's one host read is unchanged). Per step, each offloaded range copies
its grads to a host buffer (asynchronous copies into pinned memory, one wait for all), the update
runs on the host, and the new weights are copied back into the params (asynchronous, overlapping
the copies of the next ranges and the ZeRO all-gather's launch). Which ranges: the first ones in
buffer order until ``offload_fraction`` of this rank's owned elements are offloaded (whole ranges:
a ZeRO shard of a bucket, or a whole buffer without ZeRO).
"""

from __future__ import annotations

import torch


def offload_plan(ddp, cfg) -> list[bool]:
    """One flag per owned range of ``ddp`` (buffer order, then range order): offloaded or not
    (never on a CPU run, where the option is a no-op).

    Raises:
        ValueError: ``offload_fraction`` outside [0, 1], or offload with Muon (whose
            orthogonalisation runs on the device's collectives).
    """
    sizes = [e - s for i in range(len(ddp.buffers)) for s, e, _ in ddp.owned_ranges(i)]
    if not getattr(cfg, "cpu_offload", False) or ddp.ctx.device.type == "cpu":
        return [False] * len(sizes)  # a CPU run: the state is on the host already
    frac = float(cfg.offload_fraction)
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"optimizer.offload_fraction={frac} must be in [0, 1]")
    if cfg.name == "muon":
        raise ValueError("optimizer.cpu_offload is not supported with optimizer.name='muon'")
    total, done, out = sum(sizes), 0, []
    for n in sizes:
        out.append(done < frac * total)
        done += n if out[-1] else 0
    return out


def copy_grads_to_host(segments) -> None:
    """Copy the (clipped, unscaled) grads of every offloaded segment into its host buffer: async
    copies, then one wait for the device (the host step reads them next)."""
    moved = False
    for seg in segments:
        if seg.host_grad is not None:
            seg.host_grad.copy_(seg.grad, non_blocking=True)
            moved = True
    if moved and segments[0].grad.device.type == "cuda":
        torch.cuda.current_stream(segments[0].grad.device).synchronize()
