"""Optimizer CPU offload on the stand-in accelerator of :mod:`paratron.device_audit` (on a CPU run
the option changes nothing, so only a device shows where the tensors live): DP=2 with ZeRO-1,
bf16 params, two audited steps with ``optimizer.cpu_offload`` off, on, and at
``offload_fraction = 0.5``.
"""

import pytest
import torch

from paratron.device_audit import AUDIT_DEVICE_TYPE, DeviceAudit, audit_device
from paratron.local_ranks import run_ranks

from test_device_audit import AUDIT_BACKEND, FRESH, _config, _microbatches, _sanction_host_traffic

# An offloaded update runs the foreach chain (one fused call cannot mix host and device tensors),
# which rounds differently from the fused kernel in the last bit of the fp32 state: the run
# without offload uses the same chain, so that "changes nothing" can be checked bitwise.
CASES = {"off": {"adam_impl": "foreach"}, "all": {"cpu_offload": True},
         "half": {"cpu_offload": True, "offload_fraction": 0.5}}


def _device_bytes(opt) -> dict[str, int]:
    out = {"device": 0, "host": 0}
    for ts in opt.allocated_state().values():
        for t in ts:
            out["host" if t.device.type == "cpu" else "device"] += t.numel() * t.element_size()
    return out


def _rank_offload():
    from paratron.parallel.context import ParallelContext
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.timers import PhaseTimer
    from paratron.training.trainer import train_batch

    audit = DeviceAudit()
    _sanction_host_traffic(audit)
    out = {}
    for name, over in CASES.items():
        cfg = _config("bf16", False, tp=1, pp=1)
        cfg.parallel.bucket_size_mb = 0.02  # several buckets, so half of them can be offloaded
        for key, value in over.items():
            setattr(cfg.optimizer, key, value)
        with audit:
            ctx = ParallelContext.build(device=audit_device())
            torch.manual_seed(0)
            chunks, ddp, opt, sched = build_model_and_optimizer(cfg, ctx)
            timer = PhaseTimer(ctx.device)
            places = {seg.main.device.type for seg in opt.segments}
            for step in range(2):
                train_batch(cfg, ctx, chunks, ddp, opt, sched, _microbatches(cfg, ctx, step), timer=timer)
            params = {p.meta.logical_name: p.detach().elem.clone() for c in chunks for p in c.parameters()}
            state = {k: [t.elem.clone() if t.device.type != "cpu" else t.clone() for t, _ in v]
                     for k, v in opt.sharded_state_dict().items()}
        out[name] = {"places": places, "bytes": _device_bytes(opt), "params": params, "state": state,
                     "numel": sum(sg.end - sg.start for sg in opt.segments),
                     "host_grads": all(sg.host_grad is None or sg.host_grad.device.type == "cpu"
                                       for sg in opt.segments)}
    return out


@pytest.mark.slow
def test_cpu_offload_keeps_state_on_the_host_and_changes_nothing():
    """The offloaded main weights and moments are host tensors (the rest stays on the device);
    after two steps the params and the optimizer state equal the run without offload bitwise;
    device-resident optimizer bytes drop by the full 12 bytes per owned element (fp32 main weights
    and two moments) with everything offloaded, and by a part of it at fraction 0.5."""
    outs = run_ranks(_rank_offload, 2, timeout=300, pg_backend=AUDIT_BACKEND, start_method=FRESH)
    for r, o in enumerate(outs):
        off, full, half = o["off"], o["all"], o["half"]
        assert off["places"] == {AUDIT_DEVICE_TYPE} and full["places"] == {"cpu"}, r
        assert half["places"] == {"cpu", AUDIT_DEVICE_TYPE}, r
        assert full["host_grads"] and half["host_grads"]
        for case in (full, half):
            assert case["params"].keys() == off["params"].keys()
            assert all(torch.equal(case["params"][n], off["params"][n]) for n in off["params"]), r
            for k, v in off["state"].items():
                assert all(torch.equal(a, b) for a, b in zip(case["state"][k], v)), (r, k)
        assert off["bytes"]["host"] == 0 and full["bytes"]["device"] == 0
        assert off["bytes"]["device"] - full["bytes"]["device"] >= 12 * off["numel"]
        assert 0 < half["bytes"]["device"] < off["bytes"]["device"]
