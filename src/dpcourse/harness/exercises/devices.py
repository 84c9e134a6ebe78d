"""Devices a check models on a CPU: a learner's tensors as if they lived on a GPU.

On a CPU-only machine every device is the CPU, so an answer that makes a tensor on the CPU next
to a model on a GPU, or hands a CPU tensor to an NCCL collective, passes there and fails on the
first GPU. :func:`as_on_gpus` runs one call of the learner's code under the device audit's tags
(:mod:`dpcourse.harness.device_audit`): the check's tensors and modules are tagged as living on
a GPU (or on the host), and what CUDA or NCCL would refuse raises their error, which the
learner reads as theirs (:func:`dpcourse.harness.exercises.core.call_learner`). The
``make audit`` runs model whole machines; this models one call, in any run. The checks of
chapters 3 to 9 use it.

Chapter 0: the exercise checks of the whole course.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dpcourse.harness import device_audit
from dpcourse.harness.device_audit.tags import Audit, tensors_in_args
from dpcourse.harness.exercises.core import Mismatch
from dpcourse.harness.patching import LIBRARY_COLLECTIVES, replaced

__all__ = ["as_on_gpus", "expect_on_device_of"]


def _tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _tensors_of(o)


@contextlib.contextmanager
def as_on_gpus(host: Iterable[Any] = (), device: Iterable[Any] = (),
               nccl: bool = False) -> Iterator[bool]:
    """Run the learner's code, on this CPU, as on a machine with GPUs: the tensors and modules in
    ``device`` are tagged as living on a GPU and those in ``host`` on the CPU (the device audit's
    tags, :mod:`dpcourse.harness.device_audit`), and an operation that mixes them
    (``torch.empty(n)`` added to a GPU tensor, a CPU gradient given to a GPU parameter) raises
    the error CUDA would, which :func:`call_learner` reports as the learner's. With ``nccl``, on
    a rank, torch.distributed's collectives and point-to-point calls refuse a tensor on the CPU,
    as NCCL (a GPU per rank) does. The audit cannot tell two GPUs apart: only host against GPU
    is modelled. Where CUDA is in use the real devices show such errors, and nothing is
    modelled. Yields whether the devices are modelled."""
    if torch.cuda.is_available():
        yield False
        return
    for value, where in ((host, "host"), (device, "device")):
        for t in _tensors_of(list(value)):
            device_audit.tag(t, where)
    if device_audit.enabled():  # the whole process is audited already (make audit)
        yield True
        return
    mode = Audit()
    guard = _nccl_refuses_host_tensors() if nccl else contextlib.nullcontext()
    with mode, _hooks_under(mode), guard:
        yield True


@contextlib.contextmanager
def _nccl_refuses_host_tensors() -> Iterator[None]:
    """torch.distributed's collectives and sends raise, as NCCL does, when given a tensor that
    :func:`as_on_gpus` knows to be on the CPU (a buffer made without ``device=``)."""

    def refusing(name: str) -> Callable[[Callable], Callable]:
        def wrap(real: Callable) -> Callable:
            def checked(*args, **kwargs):
                hosts = [tuple(t.shape) for t in tensors_in_args(args, kwargs)
                         if device_audit.where(t) == "host"]
                if hosts:
                    raise device_audit.DeviceAuditError(
                        f"dist.{name} was given a tensor on the CPU (shape {hosts[0]}): NCCL, "
                        "the backend of a GPU per rank, takes GPU tensors only (\"No backend "
                        "type associated with device type cpu\"); make it with "
                        "device=tensor.device")
                return real(*args, **kwargs)

            return checked

        return wrap

    names = (*LIBRARY_COLLECTIVES, "send", "recv", "isend", "irecv")
    with replaced({name: refusing(name) for name in names}):
        yield


@contextlib.contextmanager
def _hooks_under(mode: Audit) -> Iterator[None]:
    """Gradient hooks registered meanwhile run under ``mode`` while it lasts: the autograd engine
    calls them with no function mode active, so a tensor a hook makes would go unchecked (what
    :func:`dpcourse.harness.device_audit.tags.audit_autograd_hooks` does for the whole process
    under ``make audit``)."""
    names = ("register_hook", "register_post_accumulate_grad_hook")
    real = {name: getattr(torch.Tensor, name) for name in names}
    lasting = [True]

    def registering(name: str) -> Callable:
        def register(self, hook):
            def under_mode(*args, **kwargs):
                if not lasting[0] or mode in torch.overrides._get_current_function_mode_stack():
                    return hook(*args, **kwargs)
                with mode:
                    return hook(*args, **kwargs)

            return real[name](self, under_mode)

        return register

    for name in names:
        setattr(torch.Tensor, name, registering(name))
    try:
        yield
    finally:
        lasting[0] = False
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)


def expect_on_device_of(got: Any, like: torch.Tensor, what: str) -> None:
    """Raise :class:`Mismatch` unless the tensor ``got`` is on ``like``'s device: the real
    devices on a GPU, the modelled ones under :func:`as_on_gpus` on the CPU."""
    if not isinstance(got, torch.Tensor):
        return
    if got.device != like.device or (device_audit.where(like) == "device"
                                      and device_audit.where(got) == "host"):
        place = "the CPU" if got.device.type == "cpu" else str(got.device)
        raise Mismatch(f"{what} is on {place}, while the input is on the rank's GPU: make it "
                       "with device=x.device (or compute it from x), so that it stays there")
