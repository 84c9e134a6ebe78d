"""Checks for chapter 2's exercises (the idea of data parallelism, ``nn.DataParallel``).

Chapter 2: the idea of data parallelism, ``nn.DataParallel``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dpcourse import data, models, replication
from dpcourse.exercises.core import Mismatch, call_learner, exercise, expect_close

# (batch size, devices): even and uneven splits, devices left idle, one device, one sample each.
CHUNK_CASES = [(30, 8), (30, 3), (9, 8), (10, 3), (7, 7), (64, 8), (100, 3), (13, 4), (5, 1),
               (1, 1)]


@exercise("ex-2-sizes", function="my_chunk_sizes", timeout=10)
def chunk_sizes(fn: Callable) -> str:
    """``fn(batch_size, n)`` against the chunk sizes of
    :func:`dpcourse.replication.chunk_data` (that is, ``torch.chunk``)."""
    for batch_size, n in CHUNK_CASES:
        want = [len(c) for c in replication.chunk_data(torch.empty(batch_size), n)]
        got = call_learner(fn, batch_size, n)
        try:
            got = [int(s) for s in got]
        except (TypeError, ValueError):
            raise Mismatch(
                f"batch of {batch_size} on {n} devices: expected a list of sizes like {want}, "
                f"got {got!r}"
            ) from None
        if got == want:
            continue
        hint = ""
        if sum(got) != batch_size:
            hint = (f" Your sizes add up to {sum(got)}, not {batch_size}: every sample must go to "
                    "exactly one device.")
        elif len(got) == n and len(want) < n:
            hint = (f" torch.chunk cuts chunks of ceil({batch_size}/{n}) = {want[0]} samples, "
                    f"which makes only {len(want)} chunks: the other devices get nothing and are "
                    "not in the list.")
        elif sorted(got, reverse=True) != want:
            hint = (f" Every chunk but the last holds ceil({batch_size}/{n}) = {want[0]} samples "
                    "and the last one what is left (that is torch.chunk's rule, not an even "
                    "spread).")
        raise Mismatch(
            f"batch of {batch_size} on {n} devices: expected {want}, got {got}.{hint}"
        )
    return f"right for all {len(CHUNK_CASES)} batches, including 9 samples on 8 devices"


def _shard_gradients(sizes: list[int]):
    """Gradients of fc1.weight on shards of the given sizes, and of the whole batch (float64)."""
    x, y = data.random_regression(num_samples=sum(sizes)).tensors
    x, y = x.double(), y.double()
    torch.manual_seed(0)
    model = models.MLP().double()
    loss = nn.MSELoss()
    whole = replication.gradients(model, (x, y), loss)["fc1.weight"]
    shards = zip(x.split(sizes), y.split(sizes), strict=True)
    parts = [replication.gradients(model, s, loss)["fc1.weight"] for s in shards]
    return parts, whole


@exercise("ex-2-combine", function="my_combine", timeout=20)
def combine_gradients(fn: Callable) -> str:
    """``fn(shard_grads, shard_sizes)`` against the gradient of the whole batch's mean loss, for
    equal and uneven shards of the MLP's data."""
    for sizes in ([50, 50], [34, 34, 32], [25, 25, 10, 40], [7]):
        parts, whole = _shard_gradients(sizes)
        got = call_learner(fn, [p.clone() for p in parts], list(sizes))
        if isinstance(got, torch.Tensor) and got.shape == whole.shape:
            n = len(sizes)
            plain = sum(parts) / n
            if n > 1 and torch.allclose(got, sum(parts)):
                raise Mismatch(
                    f"shards of sizes {sizes}: you returned the sum of the shards' gradients, "
                    f"{n} times too large. Each is the gradient of a mean loss: weigh them."
                )
            if len(set(sizes)) > 1 and torch.allclose(got, plain):
                raise Mismatch(
                    f"shards of sizes {sizes}: you returned the plain mean of the shards' "
                    f"gradients, which weighs the shard of {min(sizes)} as much as the shard of "
                    f"{max(sizes)}. Weigh shard i by its share of the batch, B_i / B."
                )
        expect_close(got, whole, f"shards of sizes {sizes}: the gradient of fc1.weight",
                     rtol=1e-9, atol=1e-12)
    return "equal to the whole batch's gradient for equal and uneven shards"
