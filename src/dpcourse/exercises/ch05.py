"""Checks for chapter 5's exercises (collective communication).

Chapter 5: checks for the collectives exercises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dpcourse.exercises.core import Mismatch, any_rank, exercise, run_learner_on_ranks

WORLD_SIZES = (2, 4, 5)
RANK_TIMEOUT = 40.0  # seconds for one world size; a deadlock ends here


def _broadcast_on_rank(fn: Callable) -> list[str]:
    """Runs on every rank: the learner's broadcast from every root, against dist.broadcast."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    sends = [0]
    real_send, real_isend = dist.send, dist.isend

    def counted(real):
        # Only messages of the data (float32) count: the collectives' shape check sends a few
        # int64 numbers first, which is not part of the tree.
        def wrapper(*args, **kwargs):
            tensor = args[0] if args else kwargs.get("tensor")
            if getattr(tensor, "dtype", None) == torch.float32:
                sends[0] += 1
            return real(*args, **kwargs)

        return wrapper

    for src in range(world):
        for n in (1, 7, 1000):
            x = torch.arange(n, dtype=torch.float32) + 100 * rank
            want = x.clone()
            dist.broadcast(want, src)
            got = x.clone()
            sends[0] = 0
            dist.send, dist.isend = counted(real_send), counted(real_isend)
            try:
                fn(got, src)
            finally:
                dist.send, dist.isend = real_send, real_isend
            rounds = (world - 1).bit_length()
            if rank == src and sends[0] > rounds:
                problems.append(
                    f"world size {world}, root {src}: the root sent {sends[0]} messages, but in a "
                    f"binomial tree it sends only ceil(log2 {world}) = {rounds}: the ranks that "
                    "already have the data must pass it on"
                )
            elif not torch.equal(got, want):
                wrong = (got != want).nonzero()[0].item()
                problems.append(
                    f"world size {world}, root {src}, {n} elements: rank {rank} ended with "
                    f"{got[wrong].item():g} at index {wrong}, expected {want[wrong].item():g} "
                    f"(rank {src}'s value)"
                )
            if any_rank(bool(problems)):
                return problems
    return problems


@exercise("ex-5-tree-broadcast", function="my_tree_broadcast", timeout=120)
def tree_broadcast(fn: Callable) -> str:
    """``fn(tensor, src)`` broadcasts in place on world sizes 2, 4 and 5, from every root, with
    the root sending only ceil(log2 N) messages of the data (float32 tensors passed to
    ``dist.send``/``dist.isend``)."""
    for world in WORLD_SIZES:
        results = run_learner_on_ranks(_broadcast_on_rank, world, fn, timeout=RANK_TIMEOUT)
        problems = [p for r in results for p in r]
        if problems:
            raise Mismatch(problems[0])
    return (
        f"broadcasts from every root on {', '.join(map(str, WORLD_SIZES))} ranks, as a tree "
        "(the root sends log2 N messages)"
    )


@exercise("ex-5-rounds", function="broadcast_rounds", timeout=10)
def rounds(fn: Callable) -> str:
    """``fn(world_size)``: rounds of a binomial-tree broadcast, for N = 1 .. 2100."""
    from dpcourse.collectives import tree_rounds
    from dpcourse.exercises.core import call_learner

    for n in range(1, 2101):
        got, want = call_learner(fn, n), tree_rounds(n)
        if got != want:
            hint = ""
            if got == n - 1:
                hint = " (that is the line, one send after another; in a tree the holders double)"
            elif n & (n - 1) == 0 and got == want + 1:
                hint = " (for a power of two, log2 N is exact: no rounding up)"
            raise Mismatch(f"{n} ranks: expected {want} rounds, got {got!r}{hint}")
    return "right for every N from 1 to 2100"
