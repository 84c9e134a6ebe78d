"""torchft's ``Manager`` stood in for by the course's process group: torchft's DiLoCo beside ours.

So that torchft's ``DiLoCo`` and ``LocalSGD`` run beside ours on the same ranks and inputs.

torchft's algorithms talk to a ``Manager``, which joins a quorum through a lighthouse server,
all-reduces over a fault-tolerant process group and decides whether a step commits. For a run
without faults, what they ask of it is small: ``allreduce(tensor)`` (the average over the
replicas, in place, returning a ``Work``), ``start_quorum()``, ``should_commit()`` (which
advances ``current_step()``, the counter that picks Streaming DiLoCo's next fragment), and hooks
on the state dict. :class:`GlooManager` does that over ``torch.distributed``'s default group: a
sum, then a division by the world size when the work is waited for, as the ``Manager``'s
callback does. torchft's own tests mock it the same way (with an all-reduce that does nothing).

Chapter 12: torchft's DiLoCo and LocalSGD run beside the course's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["GlooManager"]


class _AveragingWork:
    """An all-reduce in flight whose result is divided by the world size once waited for."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor, world: int) -> None:
        self.work, self.tensor, self.world, self.done = work, tensor, world, False

    def wait(self, timeout: object = None) -> bool:
        if not self.done:
            self.work.wait()
            self.tensor /= self.world
            self.done = True
        return True

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.tensor)
        return fut


class GlooManager:
    """What torchft's ``DiLoCo`` and ``LocalSGD`` call on a ``Manager``, over the default
    process group, every rank a replica that always commits."""

    _use_async_quorum = False

    def __init__(self) -> None:
        self.step = 0

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False,
                  reduce_op: object = None) -> _AveragingWork:
        work = dist.all_reduce(tensor, async_op=True)
        return _AveragingWork(work, tensor, dist.get_world_size())

    def should_commit(self, timeout: object = None) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def start_quorum(self, *args: object, **kwargs: object) -> None:
        pass

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def register_state_dict_fn(self, *args: object) -> None:
        pass

    def errored(self) -> None:
        return None
