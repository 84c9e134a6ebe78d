"""Checks for chapter 6's exercises (ring all-reduce).

Chapter 6: checks for the ring all-reduce exercises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.harness.exercises.core import (
    Mismatch,
    any_rank,
    call_collective,
    call_learner,
    exercise,
    run_learner_on_ranks,
)

RANK_TIMEOUT = 30.0  # seconds for one world size; a deadlock ends here


def _all_reduce_on_rank(fn: Callable, lengths: list[int]) -> list[str]:
    """Runs on every rank: the learner's all-reduce against dist.all_reduce."""

    rank, world = dist.get_rank(), dist.get_world_size()
    for n in lengths:
        g = torch.Generator().manual_seed(1000 * n + rank)
        # small integers: exact sums in any order; on the rank's device (NCCL takes no CPU tensor)
        x = torch.randint(-9, 10, (n,), generator=g).float().to(runtime.device())
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        returned, sent = call_collective(fn, got)
        if sent is None:
            problem = ("your function called one of torch.distributed's collectives (such as "
                       "dist.all_reduce); build the ring from point-to-point messages")
        else:
            problem = _compare(got, x, want, returned, world, n, rank)
            problem = problem or _not_a_ring(sent, world, n, rank)
        if any_rank(problem is not None):  # all ranks stop at the same case
            return [problem] if problem else []
    return []


def _compare(got, x, want, returned, world: int, n: int, rank: int) -> str | None:
    if torch.equal(got, x) and n > 0 and not torch.equal(x, want):
        if isinstance(returned, torch.Tensor) and torch.equal(returned, want):
            return (
                f"{world} ranks, {n} elements: the result is right but the tensor was not "
                "changed in place (write the sums into the tensor you were given)"
            )
        return f"{world} ranks, {n} elements: the tensor was not changed at all"
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero().flatten()
    i = bad[0].item()
    note = ""
    if n % world and bad.numel() <= n % world + world:
        note = (
            f" Only {bad.numel()} of {n} values are wrong: does your ring handle a "
            f"length that is not a multiple of {world}?"
        )
    elif torch.equal(got, x * world) or torch.allclose(got, want / world):
        note = " Is it a mean where a sum was asked for, or the other way round?"
    return (
        f"{world} ranks, {n} elements: rank {rank} has {got[i].item():g} at index "
        f"{i}, expected {want[i].item():g}.{note}"
    )


def _not_a_ring(sent: list[tuple[int, int]], world: int, n: int, rank: int) -> str | None:
    """A ring sends only to its right neighbour, 2(N-1) chunks of about n/N elements; a gather
    to one rank (the naive all-reduce) sends elsewhere, or N-1 whole tensors."""
    right = (rank + 1) % world
    others = sorted({peer for peer, _ in sent if peer != right})
    if others:
        return (f"{world} ranks, {n} elements: rank {rank} sent to rank(s) {others}; in a ring "
                f"each rank sends only to its right neighbour, rank {right} (a gather to one "
                "rank is the naive all-reduce of chapter 5)")
    most = 2 * (world - 1) * -(-n // world) * 4  # 2(N-1) chunks of at most ceil(n/N) floats
    total = sum(nbytes for _, nbytes in sent)
    if total > most:
        return (f"{world} ranks, {n} elements: rank {rank} sent {total:,} bytes, where a ring "
                f"sends 2(N-1) chunks of n/N values, at most {most:,} bytes: send chunks of "
                "the tensor, not the whole of it")
    return None


@exercise("ex-6-ring", function="my_ring_all_reduce", timeout=180)
def ring_all_reduce(fn: Callable) -> str:
    """``fn(tensor)`` sums in place over all ranks on 4 ranks (and 3 and 2), for lengths that
    are multiples of N, not multiples, and shorter than N, sending only to the right neighbour
    and no more than the ring's 2(N-1) chunks; ``dist.all_reduce`` itself and a gather to one
    rank are rejected; a deadlock is stopped and shown."""
    cases = {4: [8, 1000, 10, 3, 1], 3: [9, 100, 2], 2: [6, 7]}
    for world, lengths in cases.items():
        results = run_learner_on_ranks(
            _all_reduce_on_rank, world, fn, lengths, timeout=RANK_TIMEOUT
        )
        problems = [p for r in results for p in r]
        if problems:
            raise Mismatch(problems[0])
    return "equals dist.all_reduce on 4, 3 and 2 ranks, for every length tried"


@exercise("ex-6-bytes", function="ring_bytes_sent", timeout=10)
def ring_bytes(fn: Callable) -> str:
    """``fn(nbytes, world_size)``: bytes each rank sends in a ring all-reduce of ``nbytes`` bytes
    that N divides, against the count measured on the message layer's formula."""

    for world in (1, 2, 3, 4, 8, 64, 1024):
        nbytes = 4 * world * 1000
        want = 2 * (world - 1) * nbytes // world
        got = call_learner(fn, nbytes, world)
        if got != want:
            hint = ""
            if got == (world - 1) * nbytes // world:
                hint = " (that is one phase: the all-gather sends as much as the reduce-scatter)"
            elif got == 2 * (world - 1) * nbytes:
                hint = " (each step sends one chunk, 1/N of the data, not all of it)"
            raise Mismatch(f"{nbytes:,} bytes on {world} ranks: expected {want:,} bytes sent per "
                           f"rank, got {got!r}{hint}")
    return "2(N-1)/N of the data per rank, for N from 1 to 1024"
