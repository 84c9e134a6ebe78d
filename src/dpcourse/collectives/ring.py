"""Ring all-reduce from point-to-point messages.

The N ranks stand in a ring; rank r sends only to r+1 and receives only from r-1. The tensor is
cut into N chunks (:func:`~dpcourse.collectives.ops.chunk_bounds`, any length, even shorter
than N). Two phases of N-1 steps each:

1. **reduce-scatter** (:func:`reduce_scatter_`): at step s, rank r sends chunk (r-s-1) mod N and
   adds the chunk (r-s-2) mod N it receives to its own. After N-1 steps rank r holds chunk r
   fully reduced.
2. **all-gather** (:func:`all_gather_`): at step s, rank r sends chunk (r-s) mod N, complete,
   and stores the chunk (r-s-1) mod N it receives. After N-1 steps every rank holds every
   reduced chunk.

Each rank sends (N-1)/N of the data in each phase, 2(N-1)/N in all: for large N about twice the
data, however many ranks there are. That is why the ring is bandwidth-optimal.

:func:`ring_all_reduce` is those two phases, one step at a time, as drawn. The same ring with
every receive posted before the first send is :func:`ring_all_reduce_posted_ahead`, the default
wherever the backend allows it (see its docstring).

Chapter 6: ring all-reduce from point-to-point messages.
"""

from __future__ import annotations

import threading

import torch

from dpcourse.collectives.ops import check_input, combine_, finish_
from dpcourse.collectives.p2p import Waitable, exchange, irecv, isend, posts_ahead

__all__ = [
    "ring_schedule",
    "reduce_scatter_",
    "all_gather_",
    "ring_all_reduce",
    "reduce_scatter_posted_ahead_",
    "all_gather_posted_ahead_",
    "ring_all_reduce_posted_ahead",
    "ring_reduce_scatter_",
    "ring_all_gather_",
    "ring_reduce_scatter",
    "ring_all_gather",
]


def ring_schedule(phase: str, rank: int, step: int, world: int) -> tuple[int, int]:
    """(chunk sent to rank+1, chunk received from rank-1) by ``rank`` at ``step`` of a phase.

    ``phase`` is "reduce-scatter" or "all-gather". The ring below and the animation of chapter
    6 (:mod:`dpcourse.plots.ring`) both follow this schedule.
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


# ------------------------------------------------------------------- the ring, step by step
# The phases take the chunks as a list of views, ``flat.tensor_split(N)``, cut once per call:
# at 1 MiB the Python around the messages is a good part of the time.


def reduce_scatter_(chunks: list[torch.Tensor], op: str, rank: int, group=None) -> None:
    """Phase 1 in place on the N chunks of a flat tensor (``flat.tensor_split(N)``), one step at
    a time: afterwards ``chunks[rank]`` is reduced over all ranks (not yet averaged). With a
    ``group`` (of N ranks), the ring runs in that sub-group and ``rank`` is this rank's in it."""
    world = len(chunks)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = _receive_buffer(chunks[0].numel(), chunks[0])  # chunk 0 is the largest
    for step in range(world - 1):
        sent, received = ring_schedule("reduce-scatter", rank, step, world)
        buf = incoming[: chunks[received].numel()]
        exchange(chunks[sent], right, buf, left, group)  # send right, receive from the left
        combine_(chunks[received], buf, op)


def all_gather_(chunks: list[torch.Tensor], rank: int, group=None) -> None:
    """Phase 2 in place, one step at a time: rank r starts with ``chunks[r]`` complete and ends
    with all of them. ``group`` as for :func:`reduce_scatter_`."""
    world = len(chunks)
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        sent, received = ring_schedule("all-gather", rank, step, world)
        exchange(chunks[sent], right, chunks[received], left, group)  # into its chunk


def ring_all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    check_shapes: bool = True,
    post_ahead: bool | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with a ring (like ``dist.all_reduce``); returns it.

    Works for any length and world size, for every dtype the backend can send, on CPU and CUDA.
    ``check_shapes`` first verifies that all ranks passed the same size and dtype (one small
    message to the right neighbour; benchmarks turn it off). ``post_ahead``: run
    :func:`ring_all_reduce_posted_ahead` (True) or the ring step by step, as below (False); by
    default, ahead wherever the backend allows it, which is everywhere but NCCL
    (:func:`~dpcourse.collectives.p2p.posts_ahead`).
    """
    rank, world = check_input(tensor, op, check_shapes)
    if _resolve_post_ahead(post_ahead):
        return ring_all_reduce_posted_ahead(tensor, op, check_shapes=False)  # checked above
    chunks = tensor.view(-1).tensor_split(world)  # views: the ring works in place
    reduce_scatter_(chunks, op, rank)
    finish_(chunks[rank], op, world)  # each rank averages only the chunk it owns
    all_gather_(chunks, rank)
    return tensor


def _resolve_post_ahead(post_ahead: bool | None) -> bool:
    if post_ahead is None:
        return posts_ahead()
    if post_ahead and not posts_ahead():
        raise ValueError(
            "post_ahead=True cannot run on NCCL: a receive posted long before its data would "
            "block the CUDA stream that the sends behind it wait on. Leave post_ahead=None."
        )
    return post_ahead


# ------------------------------------------------------------- the ring, receives posted ahead
# Step by step (`exchange` per step: post a receive, send, wait for both) is the ring as drawn,
# and what NCCL needs. With receives posted ahead, every receive of a phase is waiting before
# the first send, so a neighbour's data is taken in the moment it is sent instead of after a
# round trip that asks for it, and each chunk is sent on the moment it is ready. That is what
# "post receives before sends" buys; benchmarks/README.md has what it measured on the course's
# 2-core machine. Same messages, same additions in the same order: the same result, bit for bit.


def _post_reduce_scatter(chunks: list[torch.Tensor], rank: int, group=None) -> list[tuple]:
    """Post phase 1's receives: (buffer, handle) per step. Each gets a slot of its own in a
    reused buffer; it cannot land in its chunk, which still holds this rank's own values.
    ``group``: a sub-group, in which ``rank`` is this rank's (as for :func:`reduce_scatter_`)."""
    world = len(chunks)
    sizes = [
        chunks[ring_schedule("reduce-scatter", rank, step, world)[1]].numel()
        for step in range(world - 1)
    ]
    slots = _receive_buffer(sum(sizes), chunks[0]).split(sizes)
    return [(slot, irecv(slot, (rank - 1) % world, group)) for slot in slots]


def _post_all_gather(chunks: list[torch.Tensor], rank: int, group=None) -> list[Waitable]:
    """Post phase 2's receives, straight into the chunks they fill. Safe even before phase 1:
    the finished chunk c reaches this rank only after going once round the ring, long after
    this rank added into c and sent it on."""
    world = len(chunks)
    return [
        irecv(chunks[ring_schedule("all-gather", rank, step, world)[1]], (rank - 1) % world,
              group)
        for step in range(world - 1)
    ]


def _wait_all(handles: list[Waitable]) -> None:
    for handle in handles:
        handle.wait()


def reduce_scatter_posted_ahead_(
    chunks: list[torch.Tensor],
    op: str,
    rank: int,
    posted: list[tuple] | None = None,
    sends: list[Waitable] | None = None,
    group=None,
) -> None:
    """:func:`reduce_scatter_` with every receive posted before the first send. ``posted``:
    this phase's receives, if the caller posted them already; ``sends``: a list to leave the
    sends in, for the caller to wait for (otherwise they are waited for here); ``group`` as
    for :func:`reduce_scatter_`. Not on NCCL."""
    world = len(chunks)
    if world == 1:
        return
    right = (rank + 1) % world
    posted = posted if posted is not None else _post_reduce_scatter(chunks, rank, group)
    mine = [] if sends is None else sends
    mine.append(isend(chunks[ring_schedule("reduce-scatter", rank, 0, world)[0]], right, group))
    for step, (buf, receive) in enumerate(posted):
        received = ring_schedule("reduce-scatter", rank, step, world)[1]
        receive.wait()
        combine_(chunks[received], buf, op)
        if step < world - 2:  # the chunk just added to is the one to send at the next step
            mine.append(isend(chunks[received], right, group))
    if sends is None:
        _wait_all(mine)


def all_gather_posted_ahead_(
    chunks: list[torch.Tensor],
    rank: int,
    posted: list[Waitable] | None = None,
    sends: list[Waitable] | None = None,
    group=None,
) -> None:
    """:func:`all_gather_` with every receive posted before the first send; ``posted``,
    ``sends`` and ``group`` as for :func:`reduce_scatter_posted_ahead_`. Not on NCCL."""
    world = len(chunks)
    if world == 1:
        return
    right = (rank + 1) % world
    posted = posted if posted is not None else _post_all_gather(chunks, rank, group)
    mine = [] if sends is None else sends
    mine.append(isend(chunks[rank], right, group))
    for step, receive in enumerate(posted):
        receive.wait()
        if step < world - 2:  # pass the chunk just received on to the right
            mine.append(isend(chunks[ring_schedule("all-gather", rank, step, world)[1]], right,
                              group))
    if sends is None:
        _wait_all(mine)


def ring_all_reduce_posted_ahead(
    tensor: torch.Tensor, op: str = "sum", check_shapes: bool = True
) -> torch.Tensor:
    """:func:`ring_all_reduce` with the receives of both phases posted before the first send.

    A posted receive waits in the background while this rank goes on sending and adding: the
    data a neighbour sends is taken in at once, and each reduced chunk is sent on the moment it
    is ready. Only where the backend allows it (gloo, MPI, the simulator; not NCCL, where a
    receive posted early would block the CUDA stream; a ValueError there).
    """
    rank, world = check_input(tensor, op, check_shapes)
    _resolve_post_ahead(True)
    if world == 1:
        return tensor
    chunks = tensor.view(-1).tensor_split(world)
    # Every receive of both phases, in the order the left neighbour sends: phase 1's first.
    scatter = _post_reduce_scatter(chunks, rank)
    gather = _post_all_gather(chunks, rank)
    sends: list[Waitable] = []
    reduce_scatter_posted_ahead_(chunks, op, rank, scatter, sends)
    finish_(chunks[rank], op, world)
    all_gather_posted_ahead_(chunks, rank, gather, sends)
    _wait_all(sends)
    return tensor


# ------------------------------------------------------------- the phases as collectives
def ring_reduce_scatter_(chunks: list[torch.Tensor], op: str, rank: int, group=None) -> None:
    """Phase 1 in place on the chunks, the fastest way this backend allows: receives posted
    ahead where :func:`~dpcourse.collectives.p2p.posts_ahead`, else step by step. Chapter 9's
    ``ShardedOptimizer`` reduce-scatters its gradients with it. ``group``: a sub-group of
    ``len(chunks)`` ranks in which ``rank`` is this rank's (chapter 11's hybrid sharding runs
    the ring inside a node)."""
    if posts_ahead():
        reduce_scatter_posted_ahead_(chunks, op, rank, group=group)
    else:
        reduce_scatter_(chunks, op, rank, group)


def ring_all_gather_(chunks: list[torch.Tensor], rank: int, group=None) -> None:
    """Phase 2 in place on the chunks, as :func:`ring_reduce_scatter_` chooses; ``group`` as
    there."""
    if posts_ahead():
        all_gather_posted_ahead_(chunks, rank, group=group)
    else:
        all_gather_(chunks, rank, group)


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
    chunks = tensor.detach().flatten().clone().tensor_split(world)
    ring_reduce_scatter_(chunks, op, rank)
    out = chunks[rank].clone()
    finish_(out, op, world)
    return out


def ring_all_gather(tensor: torch.Tensor, check_shapes: bool = True) -> list[torch.Tensor]:
    """Every rank's ``tensor``, in rank order, on every rank (like ``dist.all_gather``)."""
    rank, world = check_input(tensor, None, check_shapes)
    n = tensor.numel()
    flat = torch.empty(n * world, dtype=tensor.dtype, device=tensor.device)
    flat[rank * n : (rank + 1) * n] = tensor.detach().flatten()
    ring_all_gather_(flat.tensor_split(world), rank)
    return [flat[i * n : (i + 1) * n].view(tensor.shape).clone() for i in range(world)]
