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
from dpcourse.harness.exercises.devices import as_on_gpus

RANK_TIMEOUT = 30.0  # seconds for one world size; a deadlock ends here


def _shape(n: int, rows: int) -> tuple[int, ...]:
    return (rows, n // rows) if rows > 1 and n % rows == 0 else (n,)


def _all_reduce_on_rank(fn: Callable, lengths: list[tuple[int, torch.dtype, int]]) -> list[str]:
    """Runs on every rank: the learner's all-reduce against dist.all_reduce, on tensors of
    ``n`` elements in ``dtype``, 2-D where ``rows`` > 1 divides ``n``. The tensor is modelled on
    a GPU (:func:`as_on_gpus`), where a receive buffer made on the CPU meets it."""

    rank, world = dist.get_rank(), dist.get_world_size()
    for n, dtype, rows in lengths:
        g = torch.Generator().manual_seed(1000 * n + rank)
        # small integers: exact sums in any order and any of these dtypes; on the rank's device
        # (NCCL takes no CPU tensor)
        shape = _shape(n, rows)
        x = torch.randint(-9, 10, shape, generator=g).to(dtype).to(runtime.device())
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        with as_on_gpus(device=[got]):
            returned, sent = call_collective(fn, got)
        what = f"{world} ranks, {n} elements" + (
            f" ({'x'.join(map(str, shape))}, {str(dtype).removeprefix('torch.')})"
            if len(shape) > 1 or dtype != torch.float32 else "")
        if sent is None:
            problem = ("your function called one of torch.distributed's collectives (such as "
                       "dist.all_reduce); build the ring from point-to-point messages")
        else:
            problem = _compare(got, x, want, returned, what, world, n, rank)
            problem = problem or _not_a_ring(sent, what, world, n, rank, x.element_size())
        if any_rank(problem is not None):  # all ranks stop at the same case
            return [problem] if problem else []
    return []


def _compare(got, x, want, returned, what: str, world: int, n: int, rank: int) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return (f"{what}: the tensor became {tuple(got.shape)}, {got.dtype}: write the sums "
                "into the tensor you were given, keeping its shape and dtype")
    if torch.equal(got, x) and n > 0 and not torch.equal(x, want):
        if (isinstance(returned, torch.Tensor) and returned.shape == want.shape
                and torch.equal(returned, want)):
            return (
                f"{what}: the result is right but the tensor was not "
                "changed in place (write the sums into the tensor you were given)"
            )
        return f"{what}: the tensor was not changed at all"
    if torch.equal(got, want):
        return None
    got, x, want = got.flatten(), x.flatten(), want.flatten()
    bad = (got != want).nonzero().flatten()
    i = bad[0].item()
    note = ""
    if n % world and bad.numel() <= n % world + world:
        note = (
            f" Only {bad.numel()} of {n} values are wrong: does your ring handle a "
            f"length that is not a multiple of {world}?"
        )
    elif torch.equal(got, x * world) or torch.allclose(got.double(), want.double() / world):
        note = " Is it a mean where a sum was asked for, or the other way round?"
    return (
        f"{what}: rank {rank} has {got[i].item():g} at (flat) index "
        f"{i}, expected {want[i].item():g}.{note}"
    )


def _not_a_ring(sent: list[tuple[int, int]], what: str, world: int, n: int, rank: int,
                element_size: int) -> str | None:
    """A ring sends only to its right neighbour, 2(N-1) chunks of about n/N elements; a gather
    to one rank (the naive all-reduce) sends elsewhere, or N-1 whole tensors."""
    right = (rank + 1) % world
    others = sorted({peer for peer, _ in sent if peer != right})
    if others:
        return (f"{what}: rank {rank} sent to rank(s) {others}; in a ring "
                f"each rank sends only to its right neighbour, rank {right} (a gather to one "
                "rank is the naive all-reduce of chapter 5)")
    most = 2 * (world - 1) * -(-n // world) * element_size  # 2(N-1) chunks, ceil(n/N) values
    total = sum(nbytes for _, nbytes in sent)
    if total > most:
        return (f"{what}: rank {rank} sent {total:,} bytes, where a ring "
                f"sends 2(N-1) chunks of n/N values, at most {most:,} bytes: send chunks of "
                "the tensor, not the whole of it")
    return None


@exercise("ex-6-ring", function="my_ring_all_reduce", timeout=180)
def ring_all_reduce(fn: Callable) -> str:
    """``fn(tensor)`` sums in place over all ranks on 4 ranks (and 3 and 2), for lengths that
    are multiples of N, not multiples, and shorter than N, in float32, float64 and bfloat16,
    1-D and 2-D, sending only to the right neighbour and no more than the ring's 2(N-1)
    chunks; ``dist.all_reduce`` itself and a gather to one rank are rejected; a deadlock is
    stopped and shown."""
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    cases = {4: [(8, f32, 1), (1000, f32, 1), (10, f32, 1), (3, f32, 1), (1, f32, 1),
                 (30, f64, 5)],
             3: [(9, f32, 1), (100, f32, 1), (2, f32, 1), (14, bf16, 2)],
             2: [(6, f32, 1), (7, f64, 1)]}
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
