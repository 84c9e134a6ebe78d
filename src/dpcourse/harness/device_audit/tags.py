"""Where each tensor would live on the modelled machine: the device audit's tags.

A torch function mode tags every tensor "device" or "host" as it is made, moved, loaded or
computed, and raises where CUDA would: an operation mixing device and host tensors, ``.numpy()``
of a device tensor, a host gradient given to a device parameter. The rules are in
:mod:`dpcourse.harness.device_audit`'s docstring.

Chapter 0: the course-wide runtime (portability to GPUs, checked on a CPU).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from dpcourse.harness.device_audit.machines import ENV, DeviceAuditError

# Identity, not equality, marks the audited device: any other torch.device("cpu") is "explicit".
DEVICE = torch.device("cpu")
# What ``t.device`` gives for a host-tagged tensor, so that ``device=t.device`` follows it.
HOST = torch.device("cpu")
# What ``t.device`` gives for an untagged CPU tensor (a gradient autograd made, say): on the
# modelled machine it may name the GPU or the host, so what is made there stays untagged.
_UNKNOWN = torch.device("cpu")
_TAG = "_dpcourse_where"
_FACTORIES = frozenset(
    "tensor as_tensor zeros ones empty full rand randn randint randperm arange linspace logspace "
    "eye empty_strided normal scalar_tensor".split()
)
# Functions that legitimately take tensors on both sides, as on CUDA.
_CROSSING = frozenset(
    "to cpu cuda copy_ __getitem__ __setitem__ __repr__ __format__ __str__ "
    "item tolist numel dim size type is_floating_point element_size".split()
)
def where(t: torch.Tensor) -> str | None:
    """The audit's tag of ``t``: ``"device"``, ``"host"`` or None (unknown)."""
    return getattr(t, _TAG, None)


def tag(t: Any, value: str | None) -> None:
    """Mark ``t`` as living on ``"device"`` or ``"host"`` (None leaves it as it is)."""
    if value is not None and isinstance(t, torch.Tensor):
        try:
            setattr(t, _TAG, value)
        except (AttributeError, RuntimeError):  # some C++-made tensors take no attributes
            pass


def _untag(t: Any) -> None:
    if isinstance(t, torch.Tensor) and _TAG in getattr(t, "__dict__", {}):
        delattr(t, _TAG)


def _tag_all(obj: Any, value: str | None) -> None:
    """Tag every tensor in nested dicts, lists and tuples (None: remove the tags)."""
    if isinstance(obj, torch.Tensor):
        _untag(obj)
        tag(obj, value)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tag_all(v, value)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tag_all(v, value)


def tensors_in_args(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
                elif isinstance(b, dist.P2POp):
                    yield b.tensor


def _mismatch(what: str) -> DeviceAuditError:
    return DeviceAuditError(
        f"{what}. On a machine with GPUs this fails: a tensor made without device= "
        "stays on the CPU while the model and the rank's other tensors are on cuda:<local_rank>. "
        "Make it with device=runtime.device() or move it with .to(runtime.device()). "
        f"(Found by the device audit, {ENV}={os.environ.get(ENV)}.)"
    )


def _device_tag(target: Any) -> str | None:
    """The tag a tensor made or moved to ``target`` gets (None: unknown)."""
    if target is DEVICE:
        return "device"
    if target is HOST or (isinstance(target, str) and target.startswith("cpu")):
        return "host"
    if isinstance(target, torch.Tensor):
        return where(target)
    # _UNKNOWN, or another torch.device: torch.device(runtime.device()) copies DEVICE into a new
    # object, so the audit cannot tell which device it names
    return None


def _device_arg(args: tuple, kwargs: dict) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (torch.device, str)):
            return a
        if isinstance(a, torch.Tensor):  # t.to(other): follow other
            return a
    return None


class Audit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            return self._get(func, args, kwargs)
        if name == "__set__":
            return self._set(func, args)
        inputs = list(tensors_in_args(args, kwargs))
        seen = {where(t) for t in inputs}
        if name in ("numpy", "__array__") and "device" in seen:
            raise _mismatch("can't convert a cuda:0 device type tensor to numpy (use .cpu())")
        internal = name.startswith("_") and not name.startswith("__")
        if "device" in seen and "host" in seen and name not in _CROSSING and not internal:
            hosts = [tuple(t.shape) for t in inputs if where(t) == "host" and t.dim() > 0]
            if hosts:
                raise _mismatch(
                    f"Expected all tensors to be on the same device, but {name}() got host "
                    f"tensor(s) of shape {hosts[:3]} with tensors on the rank's device"
                )
        if name == "to" or name == "cpu":
            return self._move(func, name, args, kwargs)
        out = func(*args, **kwargs)
        if name == "_parse_to" and any(a is DEVICE for a in (*args, *kwargs.values())):
            return (DEVICE, *out[1:])  # module.to(DEVICE) parses its argument first
        if name in _FACTORIES or name.endswith("_like") or name.startswith("new_"):
            if kwargs.get("device") is not None:
                tag(out, _device_tag(kwargs["device"]))
            else:  # as on a GPU machine: the host, or where the input tensor is
                tag(out, where(inputs[0]) if inputs else "host")
            return out
        if isinstance(out, torch.Tensor) and not any(out is t for t in inputs):
            tag(out, "device" if "device" in seen else ("host" if "host" in seen else None))
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor) and where(o) is None:
                    tag(o, "device" if "device" in seen else None)
        return out

    @staticmethod
    def _get(func, args: tuple, kwargs: dict):
        out = func(*args, **kwargs)
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        if attribute == "device" and args and isinstance(args[0], torch.Tensor):
            # t.device names where t would be: device=t.device and .to(t.device) follow it
            if out.type != "cpu":  # meta, say: a real device, whatever the tags
                return out
            return {"device": DEVICE, "host": HOST}.get(where(args[0]), _UNKNOWN)
        if isinstance(out, torch.Tensor) and where(out) is None and args:
            tag(out, where(args[0]))  # p.data, t.T, p.grad...: on the same device as t
        return out

    @staticmethod
    def _set(func, args: tuple):
        attribute = getattr(getattr(func, "__self__", None), "__name__", "")
        target, value = args[0], args[1]
        if isinstance(value, torch.Tensor):
            if attribute == "grad" and {where(target), where(value)} == {"device", "host"}:
                raise _mismatch("a gradient on the host was assigned to a parameter on the device")
            out = func(*args)
            if attribute == "data":  # module.to() swaps .data: the parameter moves with it
                _untag(target)
                tag(target, where(value))
            return out
        return func(*args)

    @staticmethod
    def _move(func, name: str, args: tuple, kwargs: dict):
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        target = "cpu" if name == "cpu" else _device_arg(args, kwargs)
        out = func(*args, **kwargs)
        if target is None:  # .to(dtype) stays where it was
            if src is not None and out is not src:
                tag(out, where(src))
            return out
        value = _device_tag(target)
        if out is src and where(src) != value:
            # moving between host and GPU copies: a later write to one must not reach the other
            out = out.clone()
            if isinstance(src, torch.nn.Parameter):
                out = torch.nn.Parameter(out, requires_grad=src.requires_grad)
        _untag(out)
        tag(out, value)
        return out


def tag_parameters() -> None:
    new = torch.nn.Parameter.__new__
    if getattr(new, "_dpcourse_audited", False):
        return

    def parameter(cls, data=None, requires_grad=True):
        p = new(cls, data, requires_grad)
        tag(p, where(data) if data is not None else "host")  # a Parameter wraps a new object
        return p

    parameter._dpcourse_audited = True
    torch.nn.Parameter.__new__ = staticmethod(parameter)


def tag_loads() -> None:
    """``torch.load(f, map_location=DEVICE)`` gives device tensors, ``map_location="cpu"`` host
    ones (a tensor's tag travels in the file: without map_location it comes back as saved)."""
    load = torch.load
    if getattr(load, "_dpcourse_audited", False):
        return

    @functools.wraps(load)
    def audited_load(f, map_location=None, *args, **kwargs):
        out = load(f, map_location, *args, **kwargs)
        if map_location is not None:
            _tag_all(out, _device_tag(map_location))
        return out

    audited_load._dpcourse_audited = True
    torch.load = audited_load


def audit_autograd_hooks(mode: Callable[[], TorchFunctionMode | None]) -> None:
    """Run the hooks given to ``Tensor.register_hook`` and ``register_post_accumulate_grad_hook``
    under the audit's mode (``mode()`` returns it): the autograd engine calls them with no
    function mode active, so a hook's ``param.grad`` would carry no tag and what it hands to a
    collective would go unchecked (DDP's hooks, ex-7-hook)."""
    for name in ("register_hook", "register_post_accumulate_grad_hook"):
        real = getattr(torch.Tensor, name)
        if getattr(real, "_dpcourse_audited", False):
            continue

        def register(self, hook, _real=real):
            @functools.wraps(hook)
            def audited(*args, **kwargs):
                active = mode()
                if active is None or active in torch.overrides._get_current_function_mode_stack():
                    return hook(*args, **kwargs)
                with active:
                    return hook(*args, **kwargs)

            return _real(self, audited)

        register._dpcourse_audited = True
        setattr(torch.Tensor, name, register)

