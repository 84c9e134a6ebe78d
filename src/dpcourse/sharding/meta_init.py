"""A model too big for one rank: built on the ``meta`` device, sharded, then each shard made.

``with torch.device("meta"): model = Model()`` builds the modules with parameters that have a
shape and a dtype but no memory and no values. Wrapped then, with our
:class:`~dpcourse.sharding.fsdp.FSDP` or torch's ``fully_shard``, each rank decides which rows it
will keep before any memory exists; :meth:`FSDP.materialize` (ours) or ``model.to_empty(device)``
followed by an initialisation of each local piece (``fully_shard``'s,
:func:`materialize_dtensors`) then makes only those rows. No rank ever holds the whole model.

For the sharded initialisation to be the initialisation, every rank must draw the same values
for the same rows, whatever the number of ranks: :func:`row_seeded_init` draws each row from a
generator seeded by the parameter's name and the row's index, so the rows of N ranks put together
are exactly what one process draws whole (:func:`init_whole`). :func:`largest_model` counts the
largest model a rank can hold whole and the one N ranks can train sharded.

Chapter 11: initialising a model too big for one rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from dpcourse.sharding import zero_memory
from dpcourse.sharding.mesh import chunk_rows

__all__ = ["Init", "row_seeded_init", "init_whole", "materialize_dtensors", "largest_model"]

Init = Callable[[str, tuple[int, ...], int, int], torch.Tensor]


def row_seeded_init(std: float = 0.02, seed: int = 0) -> Init:
    """An initialisation that any rank can make row by row: ``init(name, shape, r0, r1)``
    returns rows ``r0:r1`` (fp32) of the parameter ``name`` of ``shape``. Weights (two or more
    dimensions) are N(0, std²), GPT-2's initialisation, each row from a generator seeded by
    ``seed``, the name and the row; biases and other 1-dimensional parameters are zeros."""

    def init(name: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
        width = 1
        for d in shape[1:]:
            width *= d
        if len(shape) < 2:
            return torch.zeros((r1 - r0, width))
        key = zlib.crc32(f"{seed}:{name}".encode())
        rows = torch.empty((r1 - r0, width))
        for i, r in enumerate(range(r0, r1)):
            g = torch.Generator().manual_seed(key * 1_000_003 + r)
            rows[i] = torch.randn(width, generator=g) * std
        return rows

    return init


@torch.no_grad()
def init_whole(model: nn.Module, init: Init) -> nn.Module:
    """``model`` (unwrapped, one process) with every parameter set whole by ``init``: what the
    sharded initialisations must add up to."""
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        p.copy_(init(name, shape, 0, shape[0] if shape else 1).reshape(shape))
    return model


@torch.no_grad()
def materialize_dtensors(model: nn.Module, init: Init) -> None:
    """Fill every DTensor parameter of a ``fully_shard``-ed model that ``to_empty`` gave memory
    (and no values) with its rows of ``init``: on each rank only its piece, found from the
    placements (a ``Shard(0)`` on one mesh dimension, ``Replicate()`` on the others, as FSDP2
    and HSDP place parameters) and this rank's coordinate on the mesh."""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise TypeError(f"{name} is not a DTensor: materialize_dtensors fills a fully_shard"
                            "-ed model's parameters")
        shards = [(i, s) for i, s in enumerate(p.placements) if isinstance(s, Shard)]
        if len(shards) != 1 or shards[0][1].dim != 0:
            raise ValueError(f"{name} is placed {p.placements}: expected one Shard(0)")
        mesh_dim = shards[0][0]
        shape = tuple(p.shape)
        r0, r1 = chunk_rows(shape[0] if shape else 1, p.device_mesh.size(mesh_dim),
                            p.device_mesh.get_local_rank(mesh_dim))
        local = p.to_local()
        local.copy_(init(name, shape, r0, r1).reshape(local.shape))


def largest_model(gpu_bytes: float, world_size: int = 1, stage: int = 0,
                  precision: str = "mixed", activation_bytes: float = 0.0,
                  optimizer: str = "adam") -> int:
    """The most parameters whose model states (parameters, gradients, optimizer state; chapter
    9's :func:`~dpcourse.sharding.zero_memory.memory_per_rank`) and ``activation_bytes`` fit in
    ``gpu_bytes`` on each of ``world_size`` ranks, at ZeRO ``stage`` (0: plain data parallelism,
    each rank holds everything; 3: FSDP). The buffers of the layers gathered at a time are left
    out. Bisection on the number of parameters."""
    room = gpu_bytes - activation_bytes
    if room <= 0:
        return 0

    def fits(psi: int) -> bool:
        used = zero_memory.memory_per_rank(psi, world_size, stage, precision, optimizer).total
        return used <= room

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
