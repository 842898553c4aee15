"""Activation offload (``model.activation_offload``) on the stand-in accelerator of
:mod:`paratron.device_audit` (on a CPU run the option changes nothing, so only a device shows
where the tensors live): one process, bf16, two layers, attention and MLP offloaded.

Device-resident bytes are counted by a test-owned tally of the stand-in device's tensors: every
``AuditTensor`` made is remembered by a weak reference to the host tensor behind it, and the
live ones' storages (each once) are summed.
"""

import weakref

import pytest
import torch

from paratron.config import ConfigError
from paratron.rules import load_config, validate
from paratron.device_audit import AUDIT_DEVICE_TYPE, AuditTensor, DeviceAudit, audit_device
from paratron.local_ranks import run_ranks

from test_device_audit import AUDIT_BACKEND, FRESH, _config, _microbatches, _sanction_host_traffic

OFFLOADED = ["attention", "mlp"]


def _count_device_tensors() -> list:
    """Patch AuditTensor creation to remember each one's host tensor (weakly); returns the list."""
    live = []
    orig = AuditTensor.__new__

    def new(cls, elem):
        live.append(weakref.ref(elem))
        return orig(cls, elem)

    AuditTensor.__new__ = staticmethod(new)
    return live


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _inventory(layers, names: list[str]) -> dict:
    """Test-owned saved-tensor inventory of the ``names`` submodules of ``layers`` (``"layer"``:
    the whole layer): the device
    tensors they save that are not parameters nor the tables passed to every layer (RoPE)."""
    found = {}
    keep = {p.untyped_storage().data_ptr() for layer in layers for p in layer.parameters()}

    def pack(t):
        if isinstance(t, AuditTensor) and t.untyped_storage().data_ptr() not in keep:
            found[t.untyped_storage().data_ptr()] = t.elem
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def enter(module, args):
        for a in args[1:]:  # rope tables and layout: shared by all layers
            for t in (a if isinstance(a, tuple) else (a,)):
                if isinstance(t, torch.Tensor):
                    keep.add(t.untyped_storage().data_ptr())
        hooks.__enter__()

    for layer in layers:
        for name in names:
            module = layer if name == "layer" else getattr(layer, name)
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
    return found


def _grads(chunks) -> dict:
    out = {}
    for c in chunks:
        for n, p in c.named_parameters():
            g = p.meta.main_grad
            g = p.grad if g is None else g
            out[n] = g.elem.clone() if isinstance(g, AuditTensor) else g.clone()
    return out


def _rank_offload(offloaded: list[str], recompute: str = "none"):
    import paratron.models.gpt as gpt
    from paratron.parallel.context import ParallelContext
    from paratron.training.builders import build_model_and_optimizer
    from paratron.training.timers import PhaseTimer
    from paratron.training.trainer import train_batch

    live = _count_device_tensors()
    sessions = []
    start = gpt.start_session
    gpt.start_session = lambda *a: sessions.append(start(*a)) or sessions[-1]
    audit = DeviceAudit()
    _sanction_host_traffic(audit)
    out = {}
    for name, modules in (("off", []), ("on", offloaded)):
        cfg = _config("bf16", False, tp=1, pp=1)
        cfg.model.activation_offload, cfg.model.recompute = modules, recompute
        sessions.clear()
        with audit:
            ctx = ParallelContext.build(device=audit_device())
            torch.manual_seed(0)
            chunks, ddp, opt, sched = build_model_and_optimizer(cfg, ctx)
            inventory = _inventory(list(chunks[0].layers.values()), offloaded) if name == "off" else {}
            mb = _microbatches(cfg, ctx, 0)[0]
            del live[:]
            losses = chunks[0](mb["tokens"].to(ctx.device), mb["labels"].to(ctx.device))
            loss = losses.sum()
            # Between the forward and the backward:
            device_bytes = _storage_bytes(e for r in live if (e := r()) is not None)
            inventory = _storage_bytes(inventory.values())  # this forward's (the hooks stay for the step)
            saved = [s for sess in sessions if sess for g in sess.groups for s in g.saved]
            between = {"hosts": {s.host.device.type for s in saved}, "origin": {s.device.type for s in saved},
                       "fetched": sum(s.on_device is not None for s in saved), "n": len(saved),
                       "bytes": _storage_bytes(s.host for s in saved)}
            loss.backward()
            after = {"groups_fetched": all(g.fetched for sess in sessions if sess for g in sess.groups),
                     "left_on_device": sum(s.on_device is not None for s in saved)}
            grads = _grads(chunks)
            loss = loss.elem.clone()
            train_batch(cfg, ctx, chunks, ddp, opt, sched, _microbatches(cfg, ctx, 1), timer=PhaseTimer(ctx.device))
            params = {n: p.detach().elem.clone() for c in chunks for n, p in c.named_parameters()}
        out[name] = {"device_bytes": device_bytes, "between": between, "after": after, "loss": loss,
                     "grads": grads, "params": params, "inventory": inventory}
    return out


@pytest.mark.parametrize("offloaded,recompute", [
    (OFFLOADED, "none"),
    pytest.param(["layer"], "selective", marks=pytest.mark.slow, id="layer-selective")])
def test_activation_offload_moves_saved_tensors_to_the_host_and_changes_nothing(offloaded, recompute):
    """Between the forward and the backward the offloaded activations are host copies (made from
    stand-in device tensors, none fetched back yet); the backward fetches every layer; the loss,
    the grads and the params after a whole step equal the run without offload bitwise; and
    device-resident bytes at that point drop by at least the saved activations of the offloaded
    submodules (the test's own inventory of the run without offload)."""
    off, on = run_ranks(_rank_offload, 1, offloaded, recompute, timeout=300, pg_backend=AUDIT_BACKEND, start_method=FRESH)[0].values()
    b = on["between"]
    assert b["n"] > 0 and b["hosts"] == {"cpu"} and b["origin"] == {AUDIT_DEVICE_TYPE}, b
    assert b["fetched"] == 0, b
    assert on["after"] == {"groups_fetched": True, "left_on_device": 0}, on["after"]
    assert off["between"]["n"] == 0
    assert torch.equal(on["loss"], off["loss"])
    assert on["grads"].keys() == off["grads"].keys()
    assert all(torch.equal(on["grads"][n], off["grads"][n]) for n in off["grads"])
    assert all(torch.equal(on["params"][n], off["params"][n]) for n in off["params"])
    assert off["inventory"] > 0
    assert off["device_bytes"] - on["device_bytes"] >= off["inventory"], (off["device_bytes"], on["device_bytes"],
                                                                         off["inventory"], b["bytes"])


def test_activation_offload_config_rules():
    """Unknown names and full recompute are refused before launch, naming the field."""
    from tests.conftest import ROOT

    ok = load_config(ROOT / "configs/llama-tiny.toml", ['model.activation_offload=["attention","mlp"]'])
    assert ok.model.activation_offload == ["attention", "mlp"]
    for over, words in ((['model.activation_offload=["attn"]'], "unknown module"),
                        (['model.activation_offload=["mlp"]', "model.recompute=full"], "recompute='full'"),
                        (['model.activation_offload=["mlp","mlp"]'], "twice"),
                        (['model.activation_offload=["layer"]', "model.compile=true"], "compile")):
        with pytest.raises(ConfigError, match="model.activation_offload") as e:
            validate(load_config(ROOT / "configs/llama-tiny.toml", over))
        assert words in str(e.value)


def test_activation_offload_needs_the_named_submodules():
    """A block without a named submodule is refused when the model is built, naming the field."""
    from paratron.models.offload import check_layers

    check_layers(["layer", "mlp"], [torch.nn.ModuleDict({"mlp": torch.nn.Linear(2, 2)})])
    with pytest.raises(ConfigError, match="model.activation_offload names 'attention'"):
        check_layers(["attention"], [torch.nn.ModuleDict({"mlp": torch.nn.Linear(2, 2)})])


def test_activation_offload_is_a_no_op_on_cpu():
    """On a CPU run (and in evaluation) no session starts. (``meta`` stands for a device here:
    calling ``audit_device()`` in the pytest process would break later fork-started ranks.)"""
    from paratron.models.offload import start_session

    device = torch.device("meta")
    assert start_session(OFFLOADED, torch.device("cpu"), True) is None
    assert start_session(OFFLOADED, device, False) is None
    assert start_session([], device, True) is None
    assert start_session(OFFLOADED, device, True) is not None
