"""Activation offload (``model.activation_offload``): the tensors that the named submodules of
each transformer layer save for the backward go to host memory after the layer's forward, and
come back to the device before its backward, one layer ahead.

The mechanism is PyTorch's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``):
while an offloaded submodule runs its forward, every tensor autograd saves is *packed* (copied
to the host; pinned memory and a side stream on CUDA, so the copy overlaps compute) and, in the
backward, *unpacked* (the device copy fetched earlier). The fetch of layer ``i - 1``'s tensors
starts when layer ``i``'s backward begins (a grad hook on layer ``i``'s output),
so one layer's host-to-device copy overlaps the backward of the layer above (the layer-wise
prefetch of Megatron-Core's fine-grained activation offloading).

What stays on the device: parameters and views of them (the weight a linear saves is the
parameter itself, and its backward accumulates into that parameter's main grad), tensors shared
by every layer (the RoPE tables and the sequence layout passed to each layer), and tensors
already on the host. Values are copied exactly, so a step with offload equals one without it
bitwise.

On a CPU run (``ctx.device`` is ``cpu``) the option changes nothing. State lives in one
:class:`OffloadSession` per chunk forward (per microbatch): several microbatches in flight under
pipeline parallelism each keep their own.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from paratron.config import ConfigError

"""Names ``model.activation_offload`` takes: the submodules of a transformer layer
(:class:`paratron.models.layer.TransformerLayer`), or ``"layer"`` for all of the layer's saved
tensors (residual adds and dropout masks included)."""


def check_layers(names: list[str], layers) -> None:
    """Every layer of ``layers`` has the submodules ``names`` (``"layer"`` always holds).

    Raises:
        ConfigError: a named submodule is missing (a block of another shape, ``model.block``).
    """
    for layer in layers:
        for name in names:
            if name != "layer" and not isinstance(getattr(layer, name, None), nn.Module):
                raise ConfigError(f"model.activation_offload names {name!r}, which the layers of this "
                                  f"block ({type(layer).__name__}) do not have; use 'layer' or its submodules")


@dataclass
class _Saved:
    """One packed tensor: the host copy, the device it came from, and (once fetched) its device copy."""

    host: torch.Tensor
    device: torch.device
    on_device: torch.Tensor | None = None
    ready: object = None  # CUDA: the event the device copy's stream recorded


@dataclass
class _LayerGroup:
    """The tensors one layer's offloaded submodules saved in one forward."""

    saved: list[_Saved] = field(default_factory=list)
    fetched: bool = False


class OffloadSession:
    """One chunk forward's offloaded activations, layer by layer.

    Args:
        modules: the ``model.activation_offload`` names.
        device: the model's device (not ``cpu``).
    """

    def __init__(self, modules: list[str], device: torch.device):
        self.modules = list(modules)
        self.device = device
        self.groups: list[_LayerGroup] = []
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._keep: set[int] = set()  # storage pointers that stay on the device (this layer's)

    @contextmanager
    def layer(self, layer: nn.Module, shared: tuple):
        """Run one layer's forward inside: its offloaded submodules' saved tensors are packed to
        the host. ``shared``: the extra arguments passed to every layer (RoPE tables, layout),
        which stay on the device. Wrap the output with :meth:`boundary` afterwards."""
        self.groups.append(_LayerGroup())
        self._keep = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        self._keep |= {t.untyped_storage().data_ptr() for t in _tensors(shared)}
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        if "layer" in self.modules:
            with hooks:
                yield
            return
        with ExitStack() as stack:
            for name in self.modules:  # check_layers made sure the layer has them
                stack.enter_context(_scoped(getattr(layer, name), hooks))
            yield

    def boundary(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the layer's output), hooked so that when its grad arrives (the start of the
        layer's backward) this layer's tensors are fetched (if no prefetch did) and the fetch of
        the layer below starts."""
        if out.requires_grad:
            index = len(self.groups) - 1
            out.register_hook(lambda grad: self._prefetch(index))
        return out

    def _prefetch(self, index: int) -> None:
        self.fetch(index)
        self.fetch(index - 1)

    # -- hooks ------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        if (t.device.type == "cpu" or isinstance(t, nn.Parameter)
                or t.untyped_storage().data_ptr() in self._keep):
            return t  # kept as is: unpack hands it back
        # empty_like keeps the strides of a dense tensor, so the backward sees the same layout.
        host = torch.empty_like(t, device="cpu", pin_memory=self._cuda)
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self._stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self._stream)  # the allocator keeps t until the copy is done
        else:
            host.copy_(t)  # other accelerators: an ordinary (ordered) copy
        saved = _Saved(host, t.device)
        self.groups[-1].saved.append(saved)
        return saved

    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        if packed.on_device is None:  # not prefetched (e.g. a second unpack): fetch now
            self._fetch_one(packed)
        t, packed.on_device = packed.on_device, None  # the graph holds it from here
        if self._cuda:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(packed.ready)
            t.record_stream(current)
        return t

    # -- fetch ------------------------------------------------------------------------------
    def fetch(self, index: int) -> None:
        """Start copying layer ``index``'s tensors back to the device (once)."""
        if index < 0 or self.groups[index].fetched:
            return
        self.groups[index].fetched = True
        for saved in self.groups[index].saved:
            self._fetch_one(saved)

    def _fetch_one(self, saved: _Saved) -> None:
        if not self._cuda:
            saved.on_device = saved.host.to(saved.device)
            return
        with torch.cuda.stream(self._stream):
            saved.on_device = saved.host.to(saved.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(self._stream)


@contextmanager
def _scoped(module: nn.Module, hooks):
    """``hooks`` active while ``module``'s forward runs (forward pre- and post-hooks, removed on exit)."""
    depth = []

    def enter(*_):
        hooks.__enter__()
        depth.append(1)

    def leave(*_):
        depth.pop()
        hooks.__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while depth:  # the forward raised between the two hooks
            leave()


def _tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (tuple, list)):
            out += _tensors(a)
        elif hasattr(a, "__dict__"):
            out += _tensors([v for v in vars(a).values() if isinstance(v, (torch.Tensor, tuple, list))])
    return out


def start_session(modules: list[str], device: torch.device, training: bool) -> OffloadSession | None:
    """An :class:`OffloadSession` for one chunk forward, or None where offload does nothing (no
    modules named, a CPU run, evaluation, or grad disabled)."""
    if not modules or device.type == "cpu" or not training or not torch.is_grad_enabled():
        return None
    return OffloadSession(modules, device)
