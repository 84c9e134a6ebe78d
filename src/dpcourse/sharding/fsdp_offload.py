"""CPU offload for our FSDP: the shards, their gradients and the optimizer state in host memory,
the GPU holding only the layers in use (chapter 11).

Sharding divides the model states by N; offloading takes what is left off the GPU, as
``fully_shard(..., offload_policy=CPUOffloadPolicy())`` does (and ZeRO-Offload, Ren et al.,
2021, before it): each rank's shards live on the host, so an optimizer built on
``fsdp.parameters()`` keeps its state there and steps on the CPU. What moves per step, per rank:

* **before each all-gather**, this rank's rows are copied host to device (into its chunk of the
  gather buffer, the cast to the compute dtype on the way), the ring runs on the GPU as before;
* **after each reduce-scatter**, this rank's averaged rows are copied device to host, into the
  shards' ``.grad``;
* the optimizer's step runs on the CPU, over 1/N of the model, and the next step's gathers carry
  its result to the GPU.

So the GPU holds what a layer needs while it runs (its full parameters and gradients, the
prefetched layer, the activations), and the host the rest: 4 + 4 + 8 bytes per parameter over N
with fp32 Adam. The price is the copies over PCIe (two per parameter and step, each 1/N of the
model) and an optimizer step at the CPU's speed. Ours makes the copies the simple way: through
pageable temporaries (the rows concatenated on the host, the averaged rows copied back with
``.to``), which the host waits for, so that the optimizer can never change a shard that a copy
still reads. ``fully_shard`` copies from page-locked memory without waiting and records events to
wait on before the optimizer step: faster, and more to get right. ``pin_memory`` pins our shards
as torch's field asks (a CPU-only build has nothing to pin for and skips it), though our copies
do not make use of it. Parameters outside the sharded layers stay on the device.

The core needs no branch for it: the all-gather's copy-in and the reduce-scatter's copy-out go to
wherever the shards are (``tensor.to(shard.device)``), and the optimizer follows its parameters.
:class:`OffloadedFSDP` is chapter 9's FSDP with its shards moved to the host after it is built
(:func:`offload_shards`, which also serves an HSDP). On a CPU-only machine the host is the device
and offloading changes nothing but the copies; ``tests/test_fsdp_offload.py`` checks where each
state would live on a GPU machine with the device audit, and the same numbers as without offload.

Chapter 11: what is left after sharding, moved off the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpcourse.sharding.fsdp import FSDP

__all__ = ["OffloadedFSDP", "offloads", "offload_shards"]


def offloads(policy: Any) -> bool:
    """Whether ``policy`` asks for CPU offload: torch's ``CPUOffloadPolicy`` (or anything with
    its field ``pin_memory``) does; ``None`` and the base ``OffloadPolicy`` do not."""
    if policy is None:
        return False
    if not hasattr(policy, "__dataclass_fields__") and not hasattr(policy, "pin_memory"):
        raise TypeError(f"offload_policy must be torch's OffloadPolicy or CPUOffloadPolicy (from "
                        f"torch.distributed.fsdp), got {type(policy).__name__}")
    return hasattr(policy, "pin_memory")


def offload_shards(layers: list, pin_memory: bool = True) -> None:
    """Move every shard of ``layers`` (FSDP's
    :class:`~dpcourse.sharding.fsdp_layer.ShardedLayer` list) to host memory,
    page-locked if ``pin_memory`` and a GPU is there to copy to, and put them
    back in their modules; shards on ``meta`` (no values yet) stay until
    materialised. Build the optimizer afterwards: the shards are new tensors."""
    pin = pin_memory and torch.cuda.is_available()
    for layer in layers:
        for i, shard in enumerate(layer.shards):
            if shard.is_meta:
                continue
            host = shard.detach().to("cpu", copy=True)
            layer.shards[i] = nn.Parameter(host.pin_memory() if pin else host,
                                           requires_grad=shard.requires_grad)
        layer.use_full(False)


class OffloadedFSDP(FSDP):
    """``OffloadedFSDP(module, offload_policy=CPUOffloadPolicy(), **fsdp_options)``, on every
    rank: :class:`~dpcourse.sharding.fsdp.FSDP` (the same options) whose shards live in host
    memory when ``offload_policy`` offloads (torch's ``CPUOffloadPolicy``, read as
    ``fully_shard`` reads it), so that an optimizer built on ``parameters()`` keeps its state
    there. A model built on ``meta`` is offloaded as :meth:`materialize` makes its shards."""

    def __init__(self, module: nn.Module, *, offload_policy: Any = None,
                 **fsdp_options: Any) -> None:
        super().__init__(module, **fsdp_options)
        self.offload_policy = offload_policy
        if offloads(offload_policy):
            offload_shards(self.layers, offload_policy.pin_memory)

    def materialize(self, device: torch.device | str,
                    init: Callable[[str, tuple[int, ...], int, int], torch.Tensor]) -> None:
        super().materialize(device, init)
        if offloads(self.offload_policy):
            offload_shards(self.layers, self.offload_policy.pin_memory)
