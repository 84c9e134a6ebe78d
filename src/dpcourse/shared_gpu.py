"""Ranks that share a GPU: gloo's point-to-point messages through host memory.

On a machine with fewer GPUs than ranks (one GPU: a laptop, Colab; Kaggle's two T4s with 3 or more
ranks) the course runs gloo, since NCCL refuses two ranks on one GPU, and each rank's tensors stay
on its GPU (``cuda:<local_rank % gpus>``). gloo's collectives (``all_reduce``, ``broadcast``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``) take those CUDA tensors, but its ``send``
and ``recv`` move host memory only: a CUDA tensor fails with ``writev ... Bad address`` on the
sender and "Connection closed by peer" on the receiver (seen on one H200, torch 2.11).

So that code written for a GPU per rank (``dist.send``, ``dist.isend``, ``dist.batch_isend_irecv``
of tensors on ``runtime.device()``) runs unchanged there, :func:`stage_point_to_point` replaces
torch.distributed's ``send``, ``recv``, ``isend`` and ``irecv`` by versions that copy a GPU tensor
to the host before sending it, and receive into a host buffer that ``wait()`` copies to the GPU
tensor (as NCCL's, a received tensor holds its data only once ``wait()`` has returned).
:func:`dpcourse.runtime.init_process_group` installs them in every rank whose backend is gloo and
whose device is a GPU; host tensors pass through untouched. Where a process group was started
without it (torch's own ``init_process_group``, as CS336's tests start theirs), the course's
collectives still stage their messages: :mod:`dpcourse.collectives.p2p` takes each function from
:func:`through_host`. Chapter 5 shows what it costs: two copies across PCIe per message, on top of
gloo's TCP.

Chapter 0: the course-wide runtime (chapter 5 explains it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dpcourse.stand_in import stand_in

__all__ = ["on_gpu", "replace", "StagedWork", "stage_point_to_point", "staging_installed",
           "through_host"]


def on_gpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on a GPU (standing in for a GPU machine, :mod:`dpcourse.stand_in`:
    whether it would)."""
    machine = stand_in()
    return tensor.is_cuda or (machine is not None and machine.on_device(tensor))


def replace(name: str, new: Callable) -> Callable | None:
    """Put ``new`` in place of torch.distributed's function ``name``, under both of its names;
    return what was there (None, and nothing replaced, where this torch has no such function).

    ``torch.distributed`` re-exports the functions of ``torch.distributed.distributed_c10d``, and
    code inside that module calls them by its own names (``P2POp`` checks its op against c10d's
    ``isend``/``irecv``; ``batch_isend_irecv`` calls them): a replacement must go under both names
    to be seen everywhere. The course's checks and device audit replace functions the same way
    (:mod:`dpcourse.harness.patching`).
    """
    c10d = dist.distributed_c10d
    real = getattr(c10d, name, None)
    if real is not None:
        setattr(c10d, name, new)
        setattr(dist, name, new)
    return real


class StagedWork:
    """What the staged ``isend``/``irecv`` return: torch's handle, plus the host copy to keep
    alive until the message is done, and (for a receive) the GPU tensor that ``wait()`` fills."""

    def __init__(self, work: dist.Work, host: torch.Tensor, target: torch.Tensor | None = None):
        self._work, self._host, self._target = work, host, target

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        done = self._work.wait(*args, **kwargs)
        if self._target is not None:  # a receive: its data reaches the GPU tensor now, once
            self._target.copy_(self._host)
            self._target = None
        return done

    def __getattr__(self, name: str) -> Any:  # is_completed(), exception(), ... of torch's handle
        return getattr(self._work, name)


def _with_tensor(args: tuple, kwargs: dict, tensor: torch.Tensor) -> tuple[tuple, dict]:
    """The call's arguments with its tensor (the first positional or ``tensor=``) replaced."""
    if args:
        return (tensor, *args[1:]), kwargs
    return args, {**kwargs, "tensor": tensor}


def _tensor_of(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["tensor"]


def _staged(name: str, real: Callable) -> Callable:
    @functools.wraps(real)
    def staged(*args: Any, **kwargs: Any) -> Any:
        tensor = _tensor_of(args, kwargs)
        if not on_gpu(tensor):
            return real(*args, **kwargs)
        if name in ("send", "isend"):  # the sender's copy: synchronous, then a host message
            host = tensor.detach().cpu()
            args, kwargs = _with_tensor(args, kwargs, host)
            out = real(*args, **kwargs)
            return StagedWork(out, host) if name == "isend" else out
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        args, kwargs = _with_tensor(args, kwargs, host)
        out = real(*args, **kwargs)
        if name == "recv":
            tensor.copy_(host)
            return out
        return StagedWork(out, host, tensor)

    return staged


_installed = False


def staging_installed() -> bool:
    """Whether :func:`stage_point_to_point` has run in this process."""
    return _installed


def stage_point_to_point() -> None:
    """Install the staged ``send``, ``recv``, ``isend`` and ``irecv`` in this process, under both
    of torch.distributed's names (so ``P2POp`` and ``batch_isend_irecv`` use them); idempotent."""
    global _installed
    if _installed:
        return
    for name in ("send", "recv", "isend", "irecv"):
        replace(name, _staged(name, getattr(dist.distributed_c10d, name)))
    _installed = True


def through_host(name: str) -> Callable:
    """torch.distributed's ``send``, ``recv``, ``isend`` or ``irecv`` (``name``) with a GPU
    tensor staged through host memory, whether or not :func:`stage_point_to_point` ran: for a
    process group that torch's ``init_process_group`` started (a learner's script, CS336's tests),
    where nothing installed the staging. Where it is installed, the inner (staged) function gets
    a host tensor and passes it through."""
    return _staged(name, getattr(dist.distributed_c10d, name))
