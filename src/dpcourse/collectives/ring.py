"""Ring all-reduce from point-to-point messages.

The N ranks stand in a ring; rank r sends only to r+1 and receives only from r-1. The tensor is
cut into N chunks (``flat.tensor_split(N)``: any length, even shorter than N). Two phases of N-1
steps each, whose chunk indices are :func:`ring_schedule`:

1. **reduce-scatter** (:func:`reduce_scatter_`): at step s, rank r sends chunk (r-s-1) mod N and
   adds the chunk (r-s-2) mod N it receives to its own. After N-1 steps rank r holds chunk r
   fully reduced.
2. **all-gather** (:func:`all_gather_`): at step s, rank r sends chunk (r-s) mod N, complete,
   and stores the chunk (r-s-1) mod N it receives. After N-1 steps every rank holds every
   reduced chunk.

Each rank sends (N-1)/N of the data in each phase, 2(N-1)/N in all: for large N about twice the
data, however many ranks there are. That is why the ring is bandwidth-optimal.

How each step's two messages travel is a seam, the *link* the phases call (``link.exchange``:
send one chunk, receive one into place or into a scratch buffer). The core's link,
:class:`StepByStep`, runs one step at a time, as drawn: what NCCL needs. :class:`PostedAhead` is
the layer chapter 6 adds where it teaches how gloo moves data: every receive posted before the
first send, the default wherever the backend allows it (:func:`ring_link`). Same messages, same
additions in the same order: the same result, bit for bit.

Chapter 6: ring all-reduce from point-to-point messages.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from dpcourse.collectives.ops import check_input, combine_, finish_
from dpcourse.collectives.p2p import Waitable, exchange, irecv, isend, posts_ahead

__all__ = [
    "ring_schedule",
    "StepByStep",
    "PostedAhead",
    "ring_link",
    "reduce_scatter_",
    "all_gather_",
    "ring_all_reduce",
    "ring_all_reduce_posted_ahead",
    "ring_reduce_scatter_",
    "ring_all_gather_",
    "ring_reduce_scatter",
    "ring_all_gather",
]

PHASES = ("reduce-scatter", "all-gather")


def ring_schedule(phase: str, rank: int, step: int,
                  world: int) -> tuple[int, int]:
    """(chunk sent to rank+1, chunk received from rank-1) by ``rank`` at
    ``step`` of a phase, "reduce-scatter" or "all-gather". The ring below
    and chapter 6's animation (:mod:`dpcourse.plots.ring`) follow it."""
    if phase == "reduce-scatter":
        return (rank - step - 1) % world, (rank - step - 2) % world
    if phase == "all-gather":
        return (rank - step) % world, (rank - step - 1) % world
    raise ValueError("phase must be 'reduce-scatter' or 'all-gather', "
                     f"got {phase!r}")


_buffers = threading.local()  # per thread: the simulator's virtual ranks are threads


def _reused_buffer(numel: int, like: torch.Tensor, purpose: str) -> torch.Tensor:
    """A buffer of ``numel`` elements kept per thread, dtype, device and ``purpose`` (so that
    two uses in one call never share memory). Allocating a fresh one per call costs more than
    the add it serves: large allocations are new memory mappings whose pages fault in on first
    touch (measured 0.25 ms per 512 KiB here)."""
    key = (purpose, like.dtype, like.device)
    cache = getattr(_buffers, "cache", None)
    if cache is None:
        cache = _buffers.cache = {}
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _scratch_like(chunk: torch.Tensor) -> torch.Tensor:
    """Where phase 1 receives a chunk step by step: not into the chunk, which holds this rank's
    own values."""
    return _reused_buffer(chunk.numel(), chunk, "incoming")


# ------------------------------------------------------------------- the ring, step by step
# The phases take the chunks as a list of views, ``flat.tensor_split(N)``, cut once per call:
# at 1 MiB the Python around the messages is a good part of the time.


class StepByStep:
    """The core's link: each step posts its receive, sends, and waits for
    both (:func:`~dpcourse.collectives.p2p.exchange`), the ring as drawn and
    as NCCL needs it. ``group``: a sub-group of N ranks in which ``rank`` is
    this rank's (chapter 10)."""

    def __init__(self, rank: int, world: int, group=None) -> None:
        self.right, self.left = (rank + 1) % world, (rank - 1) % world
        self.group = group

    def exchange(self, send: torch.Tensor, into: torch.Tensor | None = None,
                 like: torch.Tensor | None = None) -> torch.Tensor:
        """Send ``send`` right while receiving from the left into ``into``,
        or into a scratch buffer of ``like``'s size; returns where it
        landed."""
        receive = into if into is not None else _scratch_like(like)
        exchange(send, self.right, receive, self.left, self.group)
        return receive

    def wait_sends(self) -> None:
        """Nothing left in flight: each step waited for its own send."""


def reduce_scatter_(chunks: list[torch.Tensor], op: str, rank: int,
                    group=None, link=None) -> None:
    """Phase 1 in place on the N chunks of a flat tensor
    (``flat.tensor_split(N)``): afterwards ``chunks[rank]`` is reduced over
    all ranks (not yet averaged). ``link``: how the messages travel
    (:class:`StepByStep` by default; ``group`` is its sub-group)."""
    world = len(chunks)
    link = link or StepByStep(rank, world, group)
    for step in range(world - 1):
        sent, received = ring_schedule("reduce-scatter", rank, step, world)
        # the left neighbour's partial sum, received beside the chunk, added
        incoming = link.exchange(chunks[sent], like=chunks[received])
        combine_(chunks[received], incoming, op)


def all_gather_(chunks: list[torch.Tensor], rank: int, group=None,
                link=None) -> None:
    """Phase 2 in place: rank r starts with ``chunks[r]`` complete and ends
    with all of them. ``group`` and ``link`` as for
    :func:`reduce_scatter_`."""
    world = len(chunks)
    link = link or StepByStep(rank, world, group)
    for step in range(world - 1):
        sent, received = ring_schedule("all-gather", rank, step, world)
        # a finished chunk, straight into place
        link.exchange(chunks[sent], into=chunks[received])


def ring_all_reduce(
    tensor: torch.Tensor,
    op: str = "sum",
    check_shapes: bool = True,
    post_ahead: bool | None = None,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place with a ring (as ``dist.all_reduce``),
    returns it. Any length and world size, every dtype the backend can send,
    CPU and CUDA. ``check_shapes`` first checks that all ranks passed the
    same size and dtype (one small message; benchmarks turn it off).
    ``post_ahead``: the link (:func:`ring_link`); by default receives are
    posted ahead wherever the backend allows it, everywhere but NCCL."""
    rank, world = check_input(tensor, op, check_shapes)
    chunks = tensor.view(-1).tensor_split(world)  # views: in place
    link = ring_link(chunks, rank, post_ahead)  # how the messages travel
    reduce_scatter_(chunks, op, rank, link=link)
    finish_(chunks[rank], op, world)  # each rank averages the chunk it owns
    all_gather_(chunks, rank, link=link)
    link.wait_sends()
    return tensor


# ------------------------------------------------------------- the ring, receives posted ahead
# Step by step, a receive is posted only when its step comes: with gloo, whose sender moves data
# only once the receiver has posted, each step then pays a round trip to ask for the data. With
# receives posted ahead, every receive of a phase is waiting before the first send, so a
# neighbour's data is taken in the moment it is sent, and each chunk is sent on the moment it is
# ready. benchmarks/README.md has what it measured on the course's 2-core machine. Phase 2's
# receives land straight in the chunks they fill, which is safe even before phase 1 has begun:
# a finished chunk comes back only after going once round the ring, long after this rank added
# into it and sent it on.


class PostedAhead:
    """A link whose receives, all of those of ``phases``, are posted before
    the first send, in the order the left neighbour sends; ``exchange``
    posts its send and waits for the next receive. The default on gloo, MPI
    and the simulator; a ValueError on NCCL."""

    def __init__(self, chunks: list[torch.Tensor], rank: int, group=None,
                 phases: tuple[str, ...] = PHASES) -> None:
        _refuse_on_nccl()
        world = len(chunks)
        self.right, self.group = (rank + 1) % world, group
        self.sends: list[Waitable] = []  # waited for in wait_sends()
        into: list[torch.Tensor] = []
        for phase in phases:
            received = [chunks[ring_schedule(phase, rank, s, world)[1]]
                        for s in range(world - 1)]
            if phase == "reduce-scatter":  # a slot each: the chunk holds
                sizes = [c.numel() for c in received]  # this rank's values
                slots = _reused_buffer(sum(sizes), chunks[0], "posted")
                received = slots.split(sizes)
            into += received  # all-gather: the chunks (safe: see above)
        left = (rank - 1) % world
        self.posted = deque((t, irecv(t, left, group)) for t in into)

    def exchange(self, send: torch.Tensor, into=None,
                 like=None) -> torch.Tensor:
        self.sends.append(isend(send, self.right, self.group))
        # a slot in phase 1, ``into`` in phase 2
        landed, handle = self.posted.popleft()
        handle.wait()
        return landed

    def wait_sends(self) -> None:
        for handle in self.sends:
            handle.wait()
        self.sends.clear()


def _refuse_on_nccl() -> None:
    if not posts_ahead():
        raise ValueError("receives posted ahead cannot run on NCCL: a receive posted long "
                         "before its data would block the CUDA stream that the sends behind it "
                         "wait on. Leave post_ahead=None.")


def ring_link(chunks: list[torch.Tensor], rank: int, post_ahead: bool | None = None,
              group=None, phases: tuple[str, ...] = PHASES) -> StepByStep | PostedAhead:
    """The link for a ring on ``chunks``: :class:`PostedAhead` where the backend allows it (gloo,
    MPI, the simulated network) or ``post_ahead=True`` asks for it (a ValueError on NCCL),
    :class:`StepByStep` on NCCL or with ``post_ahead=False``."""
    if post_ahead is None:
        post_ahead = posts_ahead()
    if post_ahead:
        return PostedAhead(chunks, rank, group, phases)
    return StepByStep(rank, len(chunks), group)


def ring_all_reduce_posted_ahead(
    tensor: torch.Tensor, op: str = "sum", check_shapes: bool = True
) -> torch.Tensor:
    """:func:`ring_all_reduce` with the receives of both phases posted before the first send
    (:class:`PostedAhead`); a ValueError on NCCL."""
    return ring_all_reduce(tensor, op, check_shapes, post_ahead=True)


# ------------------------------------------------------------- the phases as collectives
def ring_reduce_scatter_(chunks: list[torch.Tensor], op: str, rank: int, group=None) -> None:
    """Phase 1 in place on the chunks, on the fastest link this backend allows
    (:func:`ring_link`). Chapter 9's ``ShardedOptimizer`` reduce-scatters its gradients with it.
    ``group``: a sub-group of ``len(chunks)`` ranks in which ``rank`` is this rank's (chapter
    11's hybrid sharding runs the ring inside a node)."""
    link = ring_link(chunks, rank, group=group, phases=("reduce-scatter",))
    reduce_scatter_(chunks, op, rank, link=link)
    link.wait_sends()


def ring_all_gather_(chunks: list[torch.Tensor], rank: int, group=None) -> None:
    """Phase 2 in place on the chunks, as :func:`ring_reduce_scatter_` runs phase 1."""
    link = ring_link(chunks, rank, group=group, phases=("all-gather",))
    all_gather_(chunks, rank, link=link)
    link.wait_sends()


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
