"""The order in which ``torch.utils.data.DistributedSampler`` hands samples to each rank, from
scratch: :func:`epoch_indices` (chapter 7 shows the order repeating when ``set_epoch`` is
forgotten, and exercise ex-7-sampler rebuilds it).

Chapter 7: DistributedDataParallel from scratch (its sampler).
"""

from __future__ import annotations

import math

import torch

__all__ = ["epoch_indices"]


def epoch_indices(
    num_samples: int, world_size: int, rank: int, epoch: int, seed: int = 0, shuffle: bool = True
) -> list[int]:
    """The sample indices ``DistributedSampler(num_replicas=world_size, rank=rank, seed=seed)``
    yields after ``set_epoch(epoch)``: a permutation seeded with ``seed + epoch``, padded by
    repeating its start to a multiple of ``world_size``, then every ``world_size``-th index
    from ``rank`` on. Chapter 7 shows the order repeating when ``set_epoch`` is forgotten."""
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    else:
        order = list(range(num_samples))
    total = math.ceil(num_samples / world_size) * world_size  # every rank gets as many
    padding = total - num_samples
    order += (order * math.ceil(padding / num_samples))[:padding]  # repeat from the start
    return order[rank:total:world_size]
