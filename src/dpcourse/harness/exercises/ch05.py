"""Checks for chapter 5's exercises (collective communication).

Chapter 5: checks for the collectives exercises.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.collectives import tree_rounds
from dpcourse.harness.exercises.core import (
    Mismatch,
    any_rank,
    call_collective,
    call_learner,
    exercise,
    run_learner_on_ranks,
)
from dpcourse.harness.exercises.devices import as_on_gpus

WORLD_SIZES = (2, 4, 5)
RANK_TIMEOUT = 40.0  # seconds for one world size; a deadlock ends here
# The tensors broadcast from every root: one value, and tensors of other dtypes and shapes (a
# receive buffer made with torch.empty(n) is float32 and 1-D)
TENSORS = (((1,), torch.float32), ((7,), torch.float64), ((4, 250), torch.bfloat16))


def _broadcast_on_rank(fn: Callable) -> list[str]:
    """Runs on every rank: the learner's broadcast from every root, against dist.broadcast."""

    rank, world = dist.get_rank(), dist.get_world_size()
    problems = []
    rounds = (world - 1).bit_length()  # ceil(log2 N)
    for src in range(world):
        for shape, dtype in TENSORS:
            n = math.prod(shape)
            x = (torch.arange(n, device=runtime.device()).reshape(shape) + 100 * rank).to(dtype)
            want = x.clone()
            dist.broadcast(want, src)
            got = x.clone()
            with as_on_gpus(device=[got]):
                _, sent = call_collective(fn, got, src)
            if sent is None:
                problems.append(
                    "your function called one of torch.distributed's collectives (such as "
                    "dist.broadcast); the exercise builds the broadcast from dist.send and "
                    "dist.recv alone"
                )
            elif rank == src and len(sent) > rounds:
                problems.append(
                    f"world size {world}, root {src}: the root sent {len(sent)} messages, but in "
                    f"a binomial tree it sends only ceil(log2 {world}) = {rounds}: the ranks that "
                    "already have the data must pass it on"
                )
            elif rank == src and 0 < len(sent) < rounds:
                problems.append(
                    f"world size {world}, root {src}: the root sent {len(sent)} message(s), "
                    "where a binomial tree's root sends one in each of its "
                    f"ceil(log2 {world}) = {rounds} rounds: passing the data on from rank to "
                    "rank is a relay of N-1 rounds, not a tree"
                )
            elif not (got.shape == want.shape and got.dtype == want.dtype
                      and torch.equal(got, want)):
                what = f"world size {world}, root {src}, a tensor of shape {shape}, {dtype}"
                if got.shape != want.shape or got.dtype != want.dtype:
                    problems.append(f"{what}: rank {rank}'s tensor became {tuple(got.shape)}, "
                                    f"{got.dtype}: receive into the tensor you were given")
                else:
                    wrong = (got != want).flatten().nonzero()[0].item()
                    problems.append(
                        f"{what}: rank {rank} ended with {got.flatten()[wrong].item():g} at "
                        f"(flat) index {wrong}, expected {want.flatten()[wrong].item():g} "
                        f"(rank {src}'s value)"
                    )
            if any_rank(bool(problems)):
                return problems
    return problems


@exercise("ex-5-tree-broadcast", function="my_tree_broadcast", timeout=120)
def tree_broadcast(fn: Callable) -> str:
    """``fn(tensor, src)`` broadcasts in place on world sizes 2, 4 and 5, from every root,
    tensors of one value, of float64 and of 2-D bfloat16 (:data:`TENSORS`), with the root
    sending exactly ceil(log2 N) messages of the data (float tensors passed to
    ``dist.send``/``dist.isend``/``batch_isend_irecv``). Rejects a line (the root sends to
    everyone), a relay (each rank passes it to the next) and ``dist.broadcast`` itself."""
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
