"""Binomial-tree broadcast and reduce from point-to-point messages.

Sending a file to 7 friends one after another takes 7 transfers in a row. If everyone who
already has it passes it on, the number of holders doubles every round: 1, 2, 4, 8, so 3 rounds
(log2 N) instead of 7 (N - 1). Ranks are numbered relative to the root, ``v = (rank - root) mod
N``; in round k the ranks with ``v < 2**k`` send to ``v + 2**k``. Reduce runs the same tree
backwards, adding on the way up. All-reduce is a reduce to rank 0 followed by a broadcast.

Chapter 5: binomial-tree broadcast and reduce.
"""

from __future__ import annotations

import torch

from dpcourse.collectives.ops import check_input, check_root, combine_, finish_
from dpcourse.collectives.p2p import recv, send

__all__ = ["tree_broadcast", "tree_reduce", "tree_all_reduce", "tree_rounds"]


def tree_rounds(world_size: int) -> int:
    """Rounds of a binomial tree over ``world_size`` ranks: ceil(log2 N)."""
    return max(0, (int(world_size) - 1).bit_length())


def tree_broadcast(tensor: torch.Tensor, src: int = 0, check_shapes: bool = True) -> torch.Tensor:
    """Copy rank ``src``'s ``tensor`` into every rank's ``tensor`` in place (like
    ``dist.broadcast``), in ceil(log2 N) rounds; returns it."""
    rank, world = check_input(tensor, None, check_shapes)
    check_root(src, world)
    v = (rank - src) % world
    for k in range(tree_rounds(world)):
        step = 1 << k
        if v < step and v + step < world:
            send(tensor, (v + step + src) % world)
        elif step <= v < 2 * step:
            recv(tensor, (v - step + src) % world)
    return tensor


def tree_reduce(
    tensor: torch.Tensor, dst: int = 0, op: str = "sum", check_shapes: bool = True
) -> torch.Tensor:
    """Reduce every rank's ``tensor`` into rank ``dst``'s, in place (like ``dist.reduce``).

    Only ``dst``'s tensor holds the result afterwards; on the other ranks it holds partial sums
    (``dist.reduce`` also leaves them unspecified). Returns the tensor.
    """
    rank, world = check_input(tensor, op, check_shapes)
    check_root(dst, world)
    v = (rank - dst) % world
    incoming = torch.empty_like(tensor)
    for k in range(tree_rounds(world)):
        step = 1 << k
        if v & step:  # pass the partial result down the tree, and stop
            send(tensor, (v - step + dst) % world)
            break
        if v + step < world:
            recv(incoming, (v + step + dst) % world)
            combine_(tensor, incoming, op)
    if rank == dst:
        finish_(tensor, op, world)
    return tensor


def tree_all_reduce(
    tensor: torch.Tensor, op: str = "sum", check_shapes: bool = True
) -> torch.Tensor:
    """All-reduce in place as a tree reduce to rank 0 then a tree broadcast; returns it."""
    check_input(tensor, op, check_shapes)
    tree_reduce(tensor, 0, op, check_shapes=False)
    return tree_broadcast(tensor, 0, check_shapes=False)
