"""A machine this process answers for instead of its own: how the course runs GPU code on a CPU.

Lesson code asks :func:`stand_in` in the few places where a GPU machine behaves differently from
this one: which backend and device a rank gets (:func:`dpcourse.runtime.choose_backend`,
:func:`dpcourse.runtime.device_for_rank`), whether a tensor is on a GPU
(:func:`dpcourse.shared_gpu.on_gpu`), and whether a rank is an NCCL rank
(:mod:`dpcourse.collectives.p2p`). Usually nothing is registered and the answer is this
machine's own. The course's device audit (``make audit``) registers a :class:`StandIn` that
models a GPU machine on a CPU; lesson code never imports the audit, only this interface.

Chapter 0: the course-wide runtime.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["StandIn", "register", "stand_in"]


class StandIn(Protocol):
    """A machine answered for instead of this one (the device audit is one).

    ``device`` is the device every rank (and the notebook) gets: an object standing for a GPU.
    """

    device: torch.device

    def active(self) -> bool:
        """Whether it is in force now (the audit: while ``DPCOURSE_DEVICE_AUDIT`` asks for it)."""
        ...

    def backend(self, world_size: int) -> str:
        """The backend the machine gives ``world_size`` ranks of one node."""
        ...

    def gpus(self) -> int | None:
        """Its GPUs per node; None where every rank has one of its own."""
        ...

    def begin_rank(self, backend: str) -> None:
        """Told in each rank, before its process group starts, which backend it stands for."""
        ...

    def rank_backend(self) -> str | None:
        """The backend this rank stands for (None outside a rank)."""
        ...

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` would live on the machine's GPU."""
        ...


_registered: StandIn | None = None


def register(machine: StandIn | None) -> None:
    """Answer for ``machine`` whenever it is active (None: for this machine again)."""
    global _registered
    _registered = machine


def stand_in() -> StandIn | None:
    """The machine this process answers for now, or None (the usual case: itself)."""
    return _registered if _registered is not None and _registered.active() else None
