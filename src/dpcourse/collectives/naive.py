"""The obvious collectives, one message at a time: the baselines.

* :func:`linear_broadcast`: the root sends the whole tensor to each other rank in turn, N-1
  transfers in a row (the "send the file to 7 friends yourself" way);
* :func:`naive_all_reduce`: every rank sends its tensor to rank 0, which adds them up and sends
  the result back to each: rank 0 moves 2(N-1) times the data, the others 2 times, and the
  time grows with N.

Chapter 5: the obvious collectives, the baselines.
"""

from __future__ import annotations

import torch

from dpcourse.collectives.ops import check_input, check_root, combine_, finish_
from dpcourse.collectives.p2p import recv, send

__all__ = ["linear_broadcast", "naive_all_reduce"]


def linear_broadcast(tensor: torch.Tensor, src: int = 0, check_shapes: bool = True) -> torch.Tensor:
    """Copy rank ``src``'s ``tensor`` to every rank in place, one send per rank; returns it."""
    rank, world = check_input(tensor, None, check_shapes)
    check_root(src, world)
    if rank == src:
        for peer in range(world):
            if peer != src:
                send(tensor, peer)
    else:
        recv(tensor, src)
    return tensor


def naive_all_reduce(
    tensor: torch.Tensor, op: str = "sum", check_shapes: bool = True
) -> torch.Tensor:
    """All-reduce in place through rank 0: gather, reduce, send back; returns it."""
    rank, world = check_input(tensor, op, check_shapes)
    if rank == 0:
        incoming = torch.empty_like(tensor)
        for peer in range(1, world):  # in rank order, so the result is deterministic
            recv(incoming, peer)
            combine_(tensor, incoming, op)
        finish_(tensor, op, world)
        for peer in range(1, world):
            send(tensor, peer)
    else:
        send(tensor, 0)
        recv(tensor, 0)
    return tensor
