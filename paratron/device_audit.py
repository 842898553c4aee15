"""A device audit for CPU-only machines: run paratron "on an accelerator" with real CPU numerics,
and fail on what a GPU would reject or wait for.

A CPU build of PyTorch has no CUDA device guard, so a tensor whose device is ``cuda`` cannot pass
through the composite kernels (matmul, linear) at all, not even as a ``FakeTensor``. The audit
therefore uses a stand-in accelerator: PyTorch's ``PrivateUse1`` device type, renamed
``auditgpu`` and given a no-op device guard. An :class:`AuditTensor` reports device
``auditgpu:0`` and holds a real CPU tensor; :class:`DeviceAudit` (a ``TorchDispatchMode`` plus a
``TorchFunctionMode``) runs every op on the CPU tensors and enforces CUDA's rules:

* an op that mixes host and accelerator tensors raises :class:`DeviceMixError` (0-dim host
  tensors pass, as CUDA treats them as scalars; ``copy_``/``to`` and host index tensors pass, as
  on CUDA);
* a ``torch.distributed`` collective on a host tensor raises :class:`DeviceMixError`, unless it
  runs inside :meth:`DeviceAudit.allow_host` (the sanctioned host path of
  :class:`paratron.parallel.comm.Group`);
* every device-to-host synchronisation is counted in :attr:`DeviceAudit.syncs` (``.item()``,
  ``bool(t)``, ``.tolist()``, blocking copies to the host, and ops with data-dependent output
  shapes such as ``nonzero``), with the op and the paratron line of each in :attr:`DeviceAudit.sync_ops`.

Only ``paratron.local_ranks`` users (the tests) need this module.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from paratron.where import package_relpath

AUDIT_DEVICE_TYPE = "auditgpu"
aten = torch.ops.aten

# Ops that may take tensors on different devices on CUDA too.
_CROSS_DEVICE = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default,
                 aten._copy_from_and_resize.default, aten.lift_fresh.default}
# CUDA accepts host index tensors here (advanced indexing moves them).
_HOST_INDEX_OK = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
                  aten._index_put_impl_.default}
# Output shapes that depend on the data: the host must wait for the device to know them.
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                   aten.unique_consecutive.default, aten.unique_dim.default,
                   aten.repeat_interleave.Tensor, aten.nonzero_static.default}


class DeviceMixError(RuntimeError):
    """An op or collective mixed host and accelerator tensors."""


def audit_device() -> torch.device:
    """The stand-in accelerator ``auditgpu:0`` (sets up the ``PrivateUse1`` backend once per
    process; the rename is process-wide and cannot be undone, which is harmless for CPU code)."""
    if torch._C._get_privateuse1_backend_name() != AUDIT_DEVICE_TYPE:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(AUDIT_DEVICE_TYPE)
    return torch.device(AUDIT_DEVICE_TYPE, 0)


class AuditTensor(torch.Tensor):
    """A tensor on the stand-in accelerator: reports ``auditgpu:0``, computes with ``elem`` (CPU)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=audit_device(), requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def data_ptr(self) -> int:
        return self.elem.data_ptr()

    def untyped_storage(self):
        return self.elem.untyped_storage()

    def __repr__(self) -> str:
        return f"AuditTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} ran on an AuditTensor outside DeviceAudit")


def _unwrap(t):
    return t.elem if isinstance(t, AuditTensor) else t


def _wrap(t):
    return AuditTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, AuditTensor) else t


def _caller() -> str:
    """``file:line`` of the innermost frame of the paratron package (by its real location,
    :mod:`paratron.where`) outside this module: where a sync came from."""
    for frame in reversed(traceback.extract_stack()):
        rel = package_relpath(frame.filename)
        if rel is not None and rel != "device_audit.py":
            return f"{rel}:{frame.lineno}"
    return "?"


def _device_kwarg(kwargs) -> str | None:
    d = kwargs.get("device")
    return None if d is None else torch.device(d).type


class _FunctionLayer(TorchFunctionMode):
    """Python-level calls that bypass the dispatcher: ``torch.tensor(..., device=acc)`` builds the
    tensor in C++ directly, and ``tolist`` reads memory without an op."""

    def __init__(self, audit: "DeviceAudit"):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else None)
        if func in (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor) and \
                _device_kwarg(kwargs) == AUDIT_DEVICE_TYPE and not isinstance(data, torch.Tensor):
            kwargs["device"] = "cpu"
            return func(*args, **kwargs).to(audit_device())
        if func is torch.Tensor.tolist and isinstance(args[0], AuditTensor):
            return args[0].cpu().tolist()  # the copy to the host counts as the sync
        return func(*args, **kwargs)


class DeviceAudit(TorchDispatchMode):
    """``with DeviceAudit() as audit:`` — see the module docstring. Build the model inside it with
    ``ctx.device = audit_device()``.

    Attributes:
        syncs: device-to-host synchronisations so far (reset it between steps to count per step).
        sync_ops: the op name of each counted sync, in order.
        collectives: ``(op name, "device" | "host")`` of every collective seen.
    """

    def __init__(self) -> None:
        super().__init__()
        audit_device()
        self.syncs = 0
        self.sync_ops: list[str] = []
        self.collectives: list[tuple[str, str]] = []
        self._host_ok = 0
        self._functions = _FunctionLayer(self)

    def __enter__(self):
        super().__enter__()
        self._functions.__enter__()
        return self

    def __exit__(self, *exc):
        self._functions.__exit__(*exc)
        return super().__exit__(*exc)

    @contextmanager
    def allow_host(self):
        """Collectives on host tensors are allowed inside (the sanctioned host-side path)."""
        self._host_ok += 1
        try:
            yield
        finally:
            self._host_ok -= 1

    def _sync(self, func) -> None:
        self.syncs += 1
        self.sync_ops.append(f"{func} at {_caller()}")

    def _check(self, func, acc: list, host: list) -> None:
        if func.namespace == "c10d":
            if acc and host:
                raise DeviceMixError(f"collective {func} mixes host and {AUDIT_DEVICE_TYPE} tensors")
            if host and not self._host_ok:
                raise DeviceMixError(f"collective {func} on a host tensor while the model is on "
                                     f"{AUDIT_DEVICE_TYPE}: NCCL rejects it")
            self.collectives.append((str(func), "device" if acc else "host"))
            return
        if not acc or func in _CROSS_DEVICE:
            return
        bad = [tuple(t.shape) for t in host if t.dim() > 0]
        if bad:
            raise DeviceMixError(f"{func} mixes {AUDIT_DEVICE_TYPE} tensors with host tensors of "
                                 f"shapes {bad}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        acc = [t for t in leaves if isinstance(t, AuditTensor)]
        host = [t for t in leaves if not isinstance(t, AuditTensor)]
        if func in _HOST_INDEX_OK:  # only the indexed tensor (first arg) must be on the device
            host = [a for a in (args[0],) if not isinstance(a, AuditTensor)]
        self._check(func, acc, host)
        target = _device_kwarg(kwargs)
        if target == AUDIT_DEVICE_TYPE:
            kwargs["device"] = torch.device("cpu")
        if acc and (func in _DATA_DEPENDENT or func is aten._local_scalar_dense.default
                    or (func is aten._to_copy.default and target == "cpu"
                        and not kwargs.get("non_blocking", False))):
            self._sync(func)
        if func is aten.copy_.default and isinstance(args[1], AuditTensor) and \
                not isinstance(args[0], AuditTensor) and not kwargs.get("non_blocking", False):
            self._sync(func)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func.namespace == "c10d" or out is None:
            return out
        schema_args = func._schema.arguments
        if schema_args and schema_args[0].alias_info is not None and schema_args[0].alias_info.is_write:
            return args[0]  # in place: the caller's tensor object
        if target == AUDIT_DEVICE_TYPE or (acc and target != "cpu"):
            return tree_map(_wrap, out)
        return out
