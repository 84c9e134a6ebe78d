"""The device audit: run on a CPU as if every rank had a GPU of its own, and fail where a GPU would.

On a machine with one GPU per rank the course picks NCCL and puts each rank's model and data on
``cuda:<local_rank>``. Code written and tested on a CPU can then break in two ways that a CPU never
shows: a tensor made without ``device=`` stays on the host and meets a GPU tensor ("Expected all
tensors to be on the same device"), or a host tensor reaches an NCCL collective ("No backend type
associated with device type cpu"). The audit finds both on a CPU-only machine.

With ``DPCOURSE_DEVICE_AUDIT=1`` in the environment, :mod:`dpcourse.runtime` hands out
:data:`DEVICE` as every rank's device (and the notebook's outside a process group). It is the CPU
(so everything computes and prints as before, on gloo), but it is one particular ``torch.device``
object, and a torch function mode tags each tensor by where it would live on the GPU machine:

* ``"device"``: made with ``device=DEVICE``, or moved with ``.to(DEVICE)`` / ``module.to(DEVICE)``;
* ``"host"``: made by a factory (``torch.zeros``, ``torch.tensor``, ``torch.randn``…) with no
  ``device=``, by ``.cpu()`` / ``.to("cpu")``, and a parameter made from a host tensor;
* results of other operations take the tag of their inputs; tensors made elsewhere (autograd's
  gradients, ``.data``), with some other explicit device or moved with ``.to(p.device)`` carry
  none and never fail (the audit cannot tell which device such a ``torch.device`` names).

An operation that mixes a "device" tensor with a "host" tensor of one or more dimensions raises
the error CUDA raises (0-dimensional host tensors are allowed, as on CUDA); ``.numpy()`` of a
"device" tensor raises; a collective (``torch.distributed.all_reduce``, ``batch_isend_irecv``…)
given a "host" tensor raises NCCL's error, except with ``DPCOURSE_DEVICE_AUDIT=gloo`` (the ranks
of an emulated cluster, which run gloo on any machine). ``make audit`` runs every notebook under
the audit; ``tests/test_device_audit.py`` runs the exercise checks and the audit's own tests.

Chapter 0: the course-wide runtime (portability to GPUs, checked on a CPU).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from dpcourse._patching import replace

__all__ = ["ENV", "DEVICE", "DeviceAuditError", "requested", "acts_as_nccl", "enable", "enabled",
           "where", "tag"]

ENV = "DPCOURSE_DEVICE_AUDIT"
# Identity, not equality, marks the audited device: any other torch.device("cpu") is "explicit".
DEVICE = torch.device("cpu")
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
_COLLECTIVES = (
    "all_reduce broadcast reduce all_gather all_gather_into_tensor all_gather_single "
    "all_gather_coalesced all_reduce_coalesced reduce_scatter reduce_scatter_tensor "
    "reduce_scatter_single all_to_all all_to_all_single gather scatter send recv isend irecv"
).split()
_OBJECT_COLLECTIVES = (
    "all_gather_object broadcast_object_list gather_object scatter_object_list".split())


class DeviceAuditError(RuntimeError):
    """What a GPU machine would have raised, found on a CPU by the device audit."""


def requested() -> bool:
    """True when the environment asks for the audit (``DPCOURSE_DEVICE_AUDIT=1``)."""
    return os.environ.get(ENV, "") not in ("", "0")


def acts_as_nccl() -> bool:
    """True where the audit stands for NCCL (not on an emulated cluster's gloo ranks): the
    collectives of :mod:`dpcourse.collectives` then take their NCCL code path (on gloo)."""
    return requested() and os.environ.get(ENV) != "gloo"


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


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
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
        f"{what}. On a machine with a GPU per rank this fails: a tensor made without device= "
        "stays on the CPU while the model and the rank's other tensors are on cuda:<local_rank>. "
        "Make it with device=runtime.device() or move it with .to(runtime.device()). "
        f"(Found by the device audit, {ENV}=1.)"
    )


def _device_arg(args: tuple, kwargs: dict) -> Any:
    if "device" in kwargs:
        return kwargs["device"]
    for a in args[1:]:
        if isinstance(a, (torch.device, str)):
            return a
        if isinstance(a, torch.Tensor):  # t.to(other): follow other
            return a
    return None


class _Audit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":
            return func(*args, **kwargs)
        if name == "__set__":
            return self._set(func, args)
        inputs = list(_tensors(args, kwargs))
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
            dev = kwargs.get("device")
            if dev is DEVICE:
                tag(out, "device")
            elif dev is None:  # as on a GPU machine: the host, or where the input tensor is
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
        target = None if name == "cpu" else _device_arg(args, kwargs)
        if name == "cpu" or (isinstance(target, str) and target.startswith("cpu")):
            out = func(*args, **kwargs)
            if out is src:  # a GPU tensor's .cpu() is a new tensor; keep the source's tag
                out = out.clone()
            tag(out, "host")
            return out
        if target is DEVICE:
            out = func(*args, **kwargs)
            if out is src and where(src) != "device":
                out = out.clone()  # .to(cuda) copies a host tensor; a later write must not alias
                if isinstance(src, torch.nn.Parameter):
                    out = torch.nn.Parameter(out, requires_grad=src.requires_grad)
            tag(out, "device")
            return out
        out = func(*args, **kwargs)
        if isinstance(target, torch.device):
            # .to(p.device) and the like: on a GPU machine it names wherever p is, which the
            # audit cannot tell from the CPU; the result is left untagged (never fails)
            if out is src:
                out = out.clone()
            _untag(out)
        elif isinstance(target, torch.Tensor):
            tag(out, where(target))
        elif target is None and src is not None and out is not src:
            tag(out, where(src))  # .to(dtype) stays where it was
        return out


_mode: _Audit | None = None


def enabled() -> bool:
    """True when the audit's mode is active on this thread."""
    return _mode is not None and _mode in torch.overrides._get_current_function_mode_stack()


def _guard(fn):
    def collective(*args, **kwargs):
        if not acts_as_nccl() or getattr(_inside_object_collective, "depth", 0):
            return fn(*args, **kwargs)
        if any(id(a) in _gloo_groups for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)  # new_group(backend="gloo") takes host tensors anywhere
        for t in _tensors(args, kwargs):
            if where(t) == "host":
                raise DeviceAuditError(
                    f"torch.distributed.{fn.__name__} got a host tensor of shape "
                    f"{tuple(t.shape)}. With NCCL (a GPU per rank) this fails with 'No backend "
                    "type associated with device type cpu': make it on runtime.device(). "
                    f"(Found by the device audit, {ENV}=1.)"
                )
        return fn(*args, **kwargs)

    return collective


_inside_object_collective = threading.local()


def _object_collective(fn):
    # torch packs the objects into tensors on the device the backend wants (CPU for gloo,
    # the current GPU for NCCL): its own tensors, not the caller's
    def collective(*args, **kwargs):
        _inside_object_collective.depth = getattr(_inside_object_collective, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside_object_collective.depth -= 1

    return collective


_gloo_groups: set[int] = set()  # ids of groups made with new_group(backend="gloo")


def _remember_gloo_groups(fn):
    def new_group(*args, **kwargs):
        group = fn(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if backend is not None and "gloo" in str(backend).lower():
            _gloo_groups.add(id(group))
        return group

    return new_group


def _patch(name: str, wrap) -> None:
    """Replace torch.distributed's ``name`` by ``wrap(it)`` for good (under both its names, see
    :mod:`dpcourse._patching`), once, where this torch version has it."""
    fn = getattr(dist.distributed_c10d, name, None)
    if fn is None or getattr(fn, "_dpcourse_audited", False):
        return
    wrapped = functools.wraps(fn)(wrap(fn))
    wrapped._dpcourse_audited = True
    replace(name, wrapped)


def _guard_collectives() -> None:
    _patch("new_group", _remember_gloo_groups)
    for name in _OBJECT_COLLECTIVES:
        _patch(name, _object_collective)
    for name in _COLLECTIVES:
        _patch(name, _guard)


def _tag_parameters() -> None:
    new = torch.nn.Parameter.__new__
    if getattr(new, "_dpcourse_audited", False):
        return

    def parameter(cls, data=None, requires_grad=True):
        p = new(cls, data, requires_grad)
        tag(p, where(data) if data is not None else "host")  # a Parameter wraps a new object
        return p

    parameter._dpcourse_audited = True
    torch.nn.Parameter.__new__ = staticmethod(parameter)


def enable() -> None:
    """Start the audit in this process (idempotent): the function mode and the collectives' guard.

    Called by :mod:`dpcourse.runtime` when :func:`requested`; a test may call it directly.
    """
    global _mode
    _guard_collectives()
    _tag_parameters()
    if not enabled():
        _mode = _Audit()
        _mode.__enter__()  # stays on for the life of the process (a kernel, a rank)
