"""What the modelled machine's backend refuses: the device audit's guards on torch.distributed.

In a rank that stands for an NCCL rank, a collective given a host tensor raises NCCL's error; in
one that stands for a gloo rank on a shared GPU, ``send``/``recv``/``isend``/``irecv`` given a
device tensor raise gloo's, and ``fully_shard`` on the GPU raises (it crashed the ranks). Each
function is replaced once, under both of torch.distributed's names
(:mod:`dpcourse.harness.patching`).

Chapter 0: the course-wide runtime (portability to GPUs, checked on a CPU).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import threading

import torch
import torch.distributed as dist

from dpcourse.harness.device_audit import machines
from dpcourse.harness.device_audit.machines import ENV, DeviceAuditError
from dpcourse.harness.device_audit.tags import tag, tensors_in_args, where
from dpcourse.harness.patching import replace

_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_COLLECTIVES = (
    "all_reduce broadcast reduce all_gather all_gather_into_tensor all_gather_single "
    "all_gather_coalesced all_reduce_coalesced reduce_scatter reduce_scatter_tensor "
    "reduce_scatter_single all_to_all all_to_all_single gather scatter"
).split() + list(_POINT_TO_POINT)
_OBJECT_COLLECTIVES = (
    "all_gather_object broadcast_object_list gather_object scatter_object_list".split())


def _inside(fn) -> str:
    return f"(Found by the device audit, {ENV}={os.environ.get(ENV)}, in torch.distributed.{fn})"


def _guard(fn):
    def collective(*args, **kwargs):
        if (machines.rank_backend() is None or getattr(_inside_object_collective, "depth", 0)
                or getattr(_inside_guard, "active", False)):
            return fn(*args, **kwargs)
        _inside_guard.active = True  # torch calls the collective again, through the audit's
        try:  # function mode (handle_torch_function), under the name that is now this guard
            return _checked(fn, args, kwargs)
        finally:
            _inside_guard.active = False

    return collective


_inside_guard = threading.local()


def _checked(fn, args: tuple, kwargs: dict):
    if any(id(a) in _gloo_groups for a in (*args, *kwargs.values())):
        backend = "gloo"  # new_group(backend="gloo") takes host tensors anywhere
    else:
        backend = machines.rank_backend()
    for t in tensors_in_args(args, kwargs):
        if backend == "nccl" and where(t) == "host":
            raise DeviceAuditError(
                f"torch.distributed.{fn.__name__} got a host tensor of shape "
                f"{tuple(t.shape)}. With NCCL (a GPU per rank) this fails with 'No backend "
                f"type associated with device type cpu': make it on runtime.device(). "
                + _inside(fn.__name__)
            )
        if backend == "gloo" and fn.__name__ in _POINT_TO_POINT and where(t) == "device":
            raise DeviceAuditError(
                f"torch.distributed.{fn.__name__} got a tensor of shape {tuple(t.shape)} on "
                "the GPU, over gloo (ranks sharing a GPU). gloo's send and recv take host "
                "tensors only: this fails with 'writev ... Bad address' on the sender and "
                "'Connection closed by peer' on the receiver. Ranks started by "
                "dpcourse.runtime stage them through host memory (dpcourse.shared_gpu); "
                "elsewhere send t.cpu() and copy what you receive into the GPU tensor. "
                + _inside(fn.__name__)
            )
    out = fn(*args, **kwargs)
    if backend == "gloo" and fn.__name__ not in _POINT_TO_POINT and (args or kwargs):
        # gloo copies a CUDA result back from the host: a write that bumps the version
        # counter of the output (the first argument), which NCCL and gloo on the CPU do not
        first = args[0] if args else next(iter(kwargs.values()))
        for t in tensors_in_args((first,), {}):
            if where(t) == "device":
                torch.autograd.graph.increment_version(t)
    return out


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


def _patched(fn) -> bool:
    """Whether ``fn``, or a function it wraps (``__wrapped__``), is the audit's."""
    while fn is not None:
        if getattr(fn, "_dpcourse_audited", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _patch(name: str, wrap) -> None:
    """Replace torch.distributed's ``name`` by ``wrap(it)`` for good (under both its names, see
    :mod:`dpcourse.harness.patching`), once, where this torch version has it."""
    fn = getattr(dist.distributed_c10d, name, None)
    if fn is None or _patched(fn):
        return
    wrapped = functools.wraps(fn)(wrap(fn))
    wrapped._dpcourse_audited = True
    replace(name, wrapped)


def guard_collectives() -> None:
    _patch("new_group", _remember_gloo_groups)
    for name in _OBJECT_COLLECTIVES:
        _patch(name, _object_collective)
    for name in _COLLECTIVES:
        _patch(name, _guard)


def _guard_fully_shard(fsdp_module) -> None:
    """Where ranks share a GPU over gloo, torch's ``fully_shard`` on the GPU crashed both ranks
    (SIGSEGV, torch 2.11): raise instead, unless it is given a CPU mesh and host parameters.
    With a GPU per rank it moves the parameters to the GPU, which the tags then say."""
    real = getattr(fsdp_module, "fully_shard", None)
    if real is None or _patched(real):
        return

    @functools.wraps(real)
    def fully_shard(module, *args, **kwargs):
        mesh = kwargs.get("mesh")
        on_cpu = mesh is not None and mesh.device_type == "cpu"
        modules = module if isinstance(module, (list, tuple)) else [module]
        params = [p for m in modules for p in m.parameters()]
        on_device = any(where(p) == "device" for p in params)
        if machines.rank_backend() == "gloo" and (not on_cpu or on_device):
            raise DeviceAuditError(
                "torch's fully_shard on the GPU over gloo (ranks sharing a GPU) killed both ranks "
                "with SIGSEGV (torch 2.11, one H200): where ranks share a GPU, run it on the host "
                "with mesh=init_device_mesh('cpu', (world_size,)) and the model on the CPU "
                f"(bench.fsdp.fully_shard_placement()). (Found by the device audit, {ENV}.)"
            )
        out = real(module, *args, **kwargs)
        if not on_cpu:  # the default mesh is the GPU's: fully_shard moved the parameters there
            for m in modules:
                for t in (*m.parameters(), *m.buffers()):
                    tag(t, "device")
        return out

    fully_shard._dpcourse_audited = True
    fsdp_module.fully_shard = fully_shard


class _WhenImported(importlib.abc.MetaPathFinder):
    """Guard ``torch.distributed.fsdp.fully_shard`` when that module is imported (importing it
    up front would cost every audited process 0.6 s)."""

    NAME = "torch.distributed.fsdp"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_guard(module):
            exec_module(module)
            _guard_fully_shard(module)

        spec.loader.exec_module = exec_and_guard
        return spec


def guard_fsdp() -> None:
    if _WhenImported.NAME in sys.modules:
        _guard_fully_shard(sys.modules[_WhenImported.NAME])
    elif not any(isinstance(f, _WhenImported) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenImported())
