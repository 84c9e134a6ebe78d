"""Checks for chapter 9's exercises (sharded optimizers, ZeRO).

Chapter 9: exercise checks for sharded optimizers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dpcourse.exercises.core import (
    Mismatch,
    any_rank,
    call_learner,
    exercise,
    run_learner_on_ranks,
)

RANK_TIMEOUT = 30.0  # seconds for one world size; a deadlock ends here
# (numel, world size) pairs: even splits, remainders, fewer elements than ranks, empty.
SHARD_CASES = [(12, 4), (10, 4), (71, 3), (7, 2), (3, 4), (1, 3), (0, 2), (1001, 8), (5, 1)]


@exercise("ex-9-shard-bounds", function="my_shard_bounds", timeout=10)
def shard_bounds(fn: Callable) -> str:
    """``fn(numel, world_size, rank)`` returns ``(start, end)`` of the rank's slice of a flat
    buffer, the ring's chunks: the first ``numel % world_size`` ranks own one element more."""
    from dpcourse.zero import shard_bounds as reference

    for numel, world in SHARD_CASES:
        got = [call_learner(fn, numel, world, r) for r in range(world)]
        want = [reference(numel, world, r) for r in range(world)]
        try:
            got = [(int(a), int(b)) for a, b in got]
        except (TypeError, ValueError):
            raise Mismatch(
                f"numel={numel}, world_size={world}: expected a pair (start, end) for each rank, "
                f"got {got!r}"
            ) from None
        if got == want:
            continue
        r = next(i for i in range(world) if got[i] != want[i])
        sizes = [b - a for a, b in got]
        hint = ""
        if sum(sizes) == numel and sizes[-1] > max(sizes[:-1], default=0) > 0:
            hint = (
                " The last rank gets the whole remainder: spread it instead, one extra element "
                "each for the first numel % world_size ranks (the ring's chunks)."
            )
        elif got[-1][1] > numel or sum(max(s, 0) for s in sizes) != numel:
            hint = (
                f" The slices must cover the {numel} elements exactly once: with chunks of "
                "ceil(numel / world_size) the last ones run past the end."
            )
        elif max(sizes) - min(sizes) > 1:
            hint = (
                " The ring's chunks differ by at most one element; slices of "
                "ceil(numel / world_size) leave the last ranks short (or empty)."
            )
        elif sizes != sorted(sizes, reverse=True):
            hint = " The longer slices come first, like torch.tensor_split's."
        raise Mismatch(
            f"numel={numel}, world_size={world}, rank {r}: expected {want[r]}, got {got[r]}. "
            f"All ranks: expected {want}, got {got}.{hint}"
        )
    return "the same slices as the ring's reduce-scatter, for every case tried"


@exercise("ex-9-owner", function="my_owner_of", timeout=10)
def owner_of(fn: Callable) -> str:
    """``fn(index, numel, world_size)``: the rank that owns element ``index``."""
    from dpcourse.zero import owner_of as reference

    for numel, world in SHARD_CASES:
        for i in range(numel):
            want, got = reference(i, numel, world), call_learner(fn, i, numel, world)
            if got != want:
                hint = ""
                if got == i * world // numel:
                    hint = (
                        " Proportional ownership (index x N // numel) is close but not the "
                        "ring's chunks, whose first numel % N ranks own one element more."
                    )
                elif got == i // -(-numel // world):
                    hint = (
                        " Not every slice is ceil(numel / N) long: after the first numel % N "
                        "ranks they are one element shorter."
                    )
                raise Mismatch(
                    f"element {i} of {numel} on {world} ranks: expected rank {want}, got "
                    f"{got!r}.{hint}"
                )
    return "the right owner for every element of every case tried"


@exercise("ex-9-memory", function="my_zero_memory", timeout=10)
def zero_memory(fn: Callable) -> str:
    """``fn(num_params, world_size, stage, k=12)``: bytes per rank of the model states under
    ZeRO, mixed-precision Adam (the paper's formulas); up to one byte of rounding allowed."""
    from dpcourse.zero_memory import zero_memory_per_rank

    cases = [(7_500_000_000, n) for n in (1, 4, 16, 64, 1024)] + [(1000, 4), (999, 3)]
    for psi, n in cases:
        for stage in range(4):
            want = zero_memory_per_rank(psi, n, stage)
            got = call_learner(fn, psi, n, stage)
            if isinstance(got, (int, float)) and abs(got - want) <= 1:
                continue
            hint = ""
            if isinstance(got, (int, float)):
                if abs(got - (want - 2 * psi)) <= 1:
                    hint = " It is 2Ψ short: the fp16 parameters (2Ψ) stay on every rank."
                elif stage == 2 and abs(got - zero_memory_per_rank(psi, n, 1)) <= 1:
                    hint = " That is stage 1: stage 2 shards the gradients (2Ψ) too."
                elif stage == 2 and abs(got - zero_memory_per_rank(psi, n, 3)) <= 1:
                    hint = " That is stage 3: stage 2 keeps the fp16 parameters whole."
                elif abs(got - zero_memory_per_rank(psi, n, stage, k=16)) <= 1:
                    hint = (
                        " K = 12 already counts the fp32 master weights (4) with Adam's two "
                        "fp32 moments (8)."
                    )
            shown = f"{got:,}" if isinstance(got, (int, float)) else repr(got)
            raise Mismatch(
                f"Ψ = {psi:,}, N = {n}, stage {stage}: expected {want:,} bytes, got {shown}.{hint}"
            )
    return "the ZeRO paper's bytes per rank for stages 0-3, Ψ = 7.5 B on 1 to 1024 ranks"


def _sharded_step_on_rank(fn: Callable, lengths: list[int], lr: float) -> list[str]:
    """Runs on every rank: the learner's reduce-scatter/step/all-gather against SGD on the
    all-reduced mean gradient."""
    import torch.distributed as dist

    from dpcourse.collectives.ops import chunk_bounds

    rank, world = dist.get_rank(), dist.get_world_size()
    for n in lengths:
        params = torch.arange(n, dtype=torch.float32) / 7.0  # the same on every rank
        g = torch.Generator().manual_seed(1000 * n + rank)
        grad = torch.randint(-9, 10, (n,), generator=g).float()  # each rank its own
        mean = grad.clone()
        dist.all_reduce(mean)
        mean /= world
        want = params - lr * mean
        start, end = chunk_bounds(n, world)[rank]
        calls: list[tuple[int, torch.Tensor]] = []

        def step_fn(shard: torch.Tensor, shard_grad: torch.Tensor, calls=calls) -> None:
            calls.append((shard.numel(), shard_grad.detach().clone()))
            with torch.no_grad():
                shard.sub_(lr * shard_grad)

        got = params.clone()
        fn(got, grad.clone(), step_fn)  # an exception here is reported with the rank
        problem = _sharded_problem(calls, got, want, mean, start, end, world, n, rank)
        if any_rank(problem is not None):
            return [problem] if problem else []
    return []


def _sharded_problem(calls, got, want, mean, start, end, world, n, rank) -> str | None:
    where = f"{world} ranks, {n} elements, rank {rank}"
    if len(calls) != 1:
        return f"{where}: step_fn was called {len(calls)} times; call it once, on your shard"
    numel, shard_grad = calls[0]
    if numel != end - start:
        extra = (
            " That is the whole tensor: step only the slice this rank owns."
            if numel == n
            else f" The rank owns elements [{start}, {end}) (the ring's chunk {rank})."
        )
        return f"{where}: step_fn got {numel} elements, expected the shard of {end - start}.{extra}"
    if shard_grad.shape != mean[start:end].shape or not torch.allclose(
        shard_grad, mean[start:end], atol=1e-6
    ):
        hint = ""
        if torch.allclose(shard_grad, mean[start:end] * world, atol=1e-5):
            hint = " It is the sum over ranks: divide by the world size (average, as DDP does)."
        return (
            f"{where}: the gradient given to step_fn is not the mean over ranks of the shard.{hint}"
        )
    if torch.allclose(got, want, atol=1e-6):
        return None
    inside = torch.allclose(got[start:end], want[start:end], atol=1e-6)
    if inside:
        return (
            f"{where}: the shard is right, but the parameters outside [{start}, {end}) were not "
            "updated: all-gather the updated shards so that every rank has all of them"
        )
    return f"{where}: the parameters after the step differ from SGD on the averaged gradient"


@exercise("ex-9-sharded-step", function="my_sharded_step", timeout=180)
def sharded_step(fn: Callable) -> str:
    """``fn(flat_params, flat_grad, step_fn)`` on every rank: reduce-scatter (mean) the flat
    gradient, call ``step_fn(shard, shard_grad)`` once on this rank's slice, all-gather the
    updated slices into ``flat_params`` (in place). Checked on 2, 3 and 4 ranks."""
    cases = {4: [12, 10, 3, 1001], 3: [9, 71], 2: [7]}
    for world, lengths in cases.items():
        results = run_learner_on_ranks(
            _sharded_step_on_rank, world, fn, lengths, 0.1, timeout=RANK_TIMEOUT
        )
        problems = [p for r in results for p in r]
        if problems:
            raise Mismatch(problems[0])
    return "reduce-scatter, a step on the shard and all-gather equal SGD on 2, 3 and 4 ranks"


# --------------------------------------------------------------------------- FSDP (stage 3)
CHUNK_CASES = [
    ([(7, 5), (7,)], 2),  # a Linear(5, 7): 7 rows do not split evenly
    ([(9, 7), (9,), (6, 9), (6,)], 4),
    ([(2, 6), (2,)], 4),  # fewer rows than ranks: two ranks hold nothing
    ([(8, 3), (8,)], 4),  # even
    ([(5, 4, 3)], 3),  # a row of a 3-D parameter is 4 x 3 elements
]


@exercise("ex-9-fsdp-chunks", function="my_gather_chunks", timeout=10)
def fsdp_chunks(fn: Callable) -> str:
    """``fn(shapes, world_size)``: the elements of each rank's chunk of an FSDP layer's gather
    buffer (each parameter cut by rows along dim 0, as the ring's chunks cut elements). Rejects
    a flat split of the layer's elements and a remainder of rows given to the last rank."""
    from dpcourse.collectives.ops import chunk_bounds
    from dpcourse.fsdp_layer import gather_chunk_numels as reference

    for shapes, world in CHUNK_CASES:
        want = reference(shapes, world)
        got = call_learner(fn, [tuple(s) for s in shapes], world)
        try:
            got = [int(n) for n in got]
        except (TypeError, ValueError):
            raise Mismatch(f"shapes={shapes}, world_size={world}: expected a list of "
                           f"{world} numbers of elements, got {got!r}") from None
        if got == want:
            continue
        where = f"shapes={shapes}, world_size={world}: expected {want}, got {got}."
        total = sum(math.prod(s) for s in shapes)
        if got == [e - s for s, e in chunk_bounds(total, world)]:
            raise Mismatch(f"{where} That splits the layer's elements evenly, as ZeRO's flat "
                           "buffer does; FSDP cuts each parameter by rows (dim 0), so a rank "
                           "holds whole rows of every parameter.")
        last = [0] * world
        for shape in shapes:
            rows, row = shape[0], math.prod(shape[1:])
            for k in range(world):
                n = rows // world + (rows % world if k == world - 1 else 0)
                last[k] += n * row
        if got == last:
            raise Mismatch(f"{where} The last rank gets every leftover row: spread them, one "
                           "more row each for the first rows % world_size ranks (the ring's "
                           "chunks).")
        if sum(got) == sum(s[0] for s in shapes):
            raise Mismatch(f"{where} You counted rows; a chunk holds elements: multiply each "
                           "parameter's rows by the elements of one row.")
        raise Mismatch(where)
    return "every rank's chunk, rows of every parameter, for every case tried"


BACKWARD_STEPS = ("all-gather parameters", "compute gradients", "reduce-scatter gradients",
                  "free full gradients", "free full parameters")


@exercise("ex-9-fsdp-order", function="my_backward_order", timeout=10)
def fsdp_order(fn: Callable) -> str:
    """``fn()`` returns the five steps of one FSDP layer's backward (:data:`BACKWARD_STEPS`) in
    an order that works. Rejects freeing the parameters before the gradients are computed, the
    reduce-scatter before them, and freeing the gradients before the reduce-scatter."""
    got = call_learner(fn)
    try:
        got = [str(step) for step in got]
    except TypeError:
        raise Mismatch(f"expected a list of the five steps, got {got!r}") from None
    if sorted(got) != sorted(BACKWARD_STEPS):
        raise Mismatch(f"expected each of {list(BACKWARD_STEPS)} once, got {got}")
    at = {step: got.index(step) for step in BACKWARD_STEPS}
    if at["compute gradients"] < at["all-gather parameters"]:
        raise Mismatch("the gradients are computed from the full parameters (dL/dx = dL/dy W): "
                       "gather them first")
    if at["free full parameters"] < at["compute gradients"]:
        raise Mismatch("you free the full parameters before backward has used them: the "
                       "gradient of the layer's input needs its weights")
    if at["reduce-scatter gradients"] < at["compute gradients"]:
        raise Mismatch("the reduce-scatter sends gradients that are not computed yet")
    if at["free full gradients"] < at["reduce-scatter gradients"]:
        raise Mismatch("you free the full gradients before the reduce-scatter has sent them: "
                       "every rank needs the others' rows of them")
    return "gather, compute, then reduce-scatter before freeing the gradients: a working order"
