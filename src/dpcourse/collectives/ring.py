"""Ring all-reduce from point-to-point messages (chapter 6).

The N ranks stand in a ring; rank r sends only to r+1 and receives only from r-1. The tensor is
cut into N chunks (:func:`~dpcourse.collectives.ops.chunk_bounds`, any length, even shorter
than N). Two phases of N-1 steps each:

1. **reduce-scatter**: at step s, rank r sends chunk (r-s-1) mod N and adds the chunk
   (r-s-2) mod N it receives to its own. After N-1 steps rank r holds chunk r fully reduced.
2. **all-gather**: at step s, rank r sends chunk (r-s) mod N, complete, and stores the chunk
   (r-s-1) mod N it receives. After N-1 steps every rank holds every reduced chunk.

Each rank sends (N-1)/N of the data in each phase, 2(N-1)/N in all: for large N about twice the
data, however many ranks there are. That is why the ring is bandwidth-optimal.
"""

from __future__ import annotations

import threading

import torch

from dpcourse.collectives.ops import check_input, chunk_bounds, combine_, finish_
from dpcourse.collectives.p2p import exchange, exchange_pieces

__all__ = ["ring_reduce_scatter", "ring_all_gather", "ring_all_reduce", "ring_schedule"]

# Chunks larger than this many elements are sent in pieces of this size during the
# reduce-scatter, so that adding one piece overlaps with receiving the next (0: never). Off by
# default: on the course's 2-core CPU machine (gloo, 2 and 4 ranks, 1-64 MiB) pieces of 256 KiB
# and 1 MiB gave no consistent gain (2026-11-21); try it where reductions and transfers run on
# different hardware.
PIPELINE_PIECE = 0


def ring_schedule(phase: str, rank: int, step: int, world: int) -> tuple[int, int]:
    """(chunk sent to rank+1, chunk received from rank-1) by ``rank`` at ``step`` of a phase.

    ``phase`` is "reduce-scatter" or "all-gather". The ring below and the animation of chapter
    6 (:mod:`dpcourse.viz_ring`) both follow this schedule.
    """
    if phase == "reduce-scatter":
        return (rank - step - 1) % world, (rank - step - 2) % world
    if phase == "all-gather":
        return (rank - step) % world, (rank - step - 1) % world
    raise ValueError(f"phase must be 'reduce-scatter' or 'all-gather', got {phase!r}")


_buffers = threading.local()  # per thread: the simulator's virtual ranks are threads


def _receive_buffer(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable buffer of at least ``numel`` elements. Allocating a fresh one per call costs
    more than the add it serves: large allocations are new memory mappings whose pages fault in
    on first touch (measured 0.25 ms per 512 KiB here)."""
    key = (like.dtype, like.device)
    cache = getattr(_buffers, "cache", None)
    if cache is None:
        cache = _buffers.cache = {}
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _reduce_scatter_(flat: torch.Tensor, op: str, rank: int, world: int) -> None:
    """Phase 1 in place on a flat tensor: afterwards chunk ``rank`` is reduced (not averaged)."""
    bounds = chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = _receive_buffer(bounds[0][1] - bounds[0][0], flat)
    for step in range(world - 1):
        sent, received = ring_schedule("reduce-scatter", rank, step, world)
        (s0, s1), (r0, r1) = bounds[sent], bounds[received]
        buf, target = incoming[: r1 - r0], flat[r0:r1]
        if 0 < PIPELINE_PIECE < r1 - r0:
            for piece in exchange_pieces(flat[s0:s1], right, buf, left, PIPELINE_PIECE):
                combine_(target[piece], buf[piece], op)
        else:
            exchange(flat[s0:s1], right, buf, left)
            combine_(target, buf, op)


def _all_gather_(flat: torch.Tensor, rank: int, world: int) -> None:
    """Phase 2 in place: rank r starts with chunk r complete and ends with all of them."""
    bounds = chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        sent, received = ring_schedule("all-gather", rank, step, world)
        (s0, s1), (r0, r1) = bounds[sent], bounds[received]
        exchange(flat[s0:s1], right, flat[r0:r1], left)


def ring_reduce_scatter(
    tensor: torch.Tensor, op: str = "sum", check_shapes: bool = True
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's chunk of the result.

    Every rank passes a tensor of the same shape and dtype. The result is chunk ``rank`` of the
    reduced tensor, flattened and split as ``torch.tensor_split(reduced.flatten(), N)`` would
    (what ``dist.reduce_scatter`` gives when fed those chunks). ``tensor`` is left unchanged.
    ``op``: "sum", "mean", "max" or "min".
    """
    rank, world = check_input(tensor, op, check_shapes)
    flat = tensor.detach().flatten().clone()
    _reduce_scatter_(flat, op, rank, world)
    start, end = chunk_bounds(flat.numel(), world)[rank]
    out = flat[start:end].clone()
    finish_(out, op, world)
    return out


def ring_all_gather(tensor: torch.Tensor, check_shapes: bool = True) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order, on every rank (like ``dist.all_gather``)."""
    rank, world = check_input(tensor, None, check_shapes)
    n = tensor.numel()
    flat = torch.empty(n * world, dtype=tensor.dtype, device=tensor.device)
    flat[rank * n : (rank + 1) * n] = tensor.detach().flatten()
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        s = (rank - step) % world
        r = (rank - step - 1) % world
        exchange(flat[s * n : (s + 1) * n], right, flat[r * n : (r + 1) * n], left)
    return [flat[i * n : (i + 1) * n].view(tensor.shape).clone() for i in range(world)]


def ring_all_reduce(
    tensor: torch.Tensor, op: str = "sum", check_shapes: bool = True
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with a ring (like ``dist.all_reduce``); returns it.

    Works for any length and world size, for every dtype the backend can send, on CPU and CUDA.
    ``check_shapes`` first verifies that all ranks passed the same size and dtype (one tiny
    all-reduce; benchmarks turn it off).
    """
    rank, world = check_input(tensor, op, check_shapes)
    if world == 1:
        return tensor
    flat = tensor.view(-1)
    _reduce_scatter_(flat, op, rank, world)
    start, end = chunk_bounds(flat.numel(), world)[rank]
    finish_(flat[start:end], op, world)  # each rank averages only the chunk it owns
    _all_gather_(flat, rank, world)
    return tensor
