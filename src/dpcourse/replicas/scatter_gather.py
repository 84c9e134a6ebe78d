"""Splitting a batch between replicas and running them: the scatter, apply and gather phases.

Chapter 2 splits a batch with :func:`chunk_data` (``nn.DataParallel``'s rule, ``torch.chunk``'s);
chapter 3 writes the phases out::

    inputs = scatter(batch, devices)              # the batch split along dim 0, chunk i on device i
    outputs = parallel_apply(replicas, inputs)    # one thread per replica
    out = gather(outputs, devices[0])             # the outputs concatenated on device 0

:func:`dpcourse.replicas.replication.data_parallel_step` puts them together with the replicas.

Chapter 2: the idea of data parallelism (chapter 3 writes each phase out).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["chunk_data", "scatter", "parallel_apply", "gather"]

Device = torch.device | str


def _batch_tensors(batch: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("a batch is a tensor or a tuple of tensors (inputs..., target)")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("a batch needs a first (batch) dimension; got a 0-dimensional tensor")
    sizes = {len(t) for t in tensors}
    if len(sizes) > 1:
        raise ValueError(f"the tensors of a batch must have the same first dimension, got {sizes}")
    return tensors


def chunk_data(batch: torch.Tensor | Sequence[torch.Tensor], n: int) -> list:
    """Split a batch along its first dimension into ``n`` nearly equal chunks, like
    ``torch.chunk`` (and so like ``nn.DataParallel``'s scatter).

    ``batch`` is a tensor ``(B, ...)`` or a tuple of them with the same ``B``; the chunks are
    views of the same type. Chunks hold ``ceil(B / n)`` samples, the last one what is left, so
    30 into 8 gives seven chunks of 4 and one of 2. As with ``torch.chunk``, that rule can make
    fewer than ``n`` chunks (9 into 8 gives 2, 2, 2, 2, 1): ``nn.DataParallel`` then uses only
    as many devices as there are chunks, and so does :func:`data_parallel_step`. Raises
    ``ValueError`` for an empty batch or one smaller than ``n``. Chapters 2 and 3.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (the number of replicas) must be a positive integer, got {n!r}")
    tensors = _batch_tensors(batch)
    size = len(tensors[0])
    if size == 0:
        raise ValueError("the batch is empty: there is nothing to split between the replicas")
    if size < n:
        raise ValueError(
            f"a batch of {size} sample(s) cannot be split between {n} replicas (each needs at "
            f"least one): use a batch of at least {n} samples, or at most {size} replicas"
        )
    pieces = [t.chunk(n) for t in tensors]
    if isinstance(batch, torch.Tensor):
        return list(pieces[0])
    return [tuple(p) for p in zip(*pieces, strict=True)]


def scatter(
    batch: torch.Tensor | Sequence[torch.Tensor], devices: Sequence[Device]
) -> list[tuple[torch.Tensor, ...]]:
    """:func:`chunk_data` into ``len(devices)`` chunks, chunk ``i`` moved to ``devices[i]``.

    Always returns tuples (a tensor batch gives 1-tuples), ready for ``replica(*chunk)``.
    May return fewer chunks than devices (see :func:`chunk_data`). Chapters 2 and 3.
    """
    devices = [torch.device(d) for d in devices]
    chunks = chunk_data(_batch_tensors(batch), len(devices))
    return [tuple(t.to(d) for t in chunk) for chunk, d in zip(chunks, devices, strict=False)]


def parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[tuple[torch.Tensor, ...]],
    threads: bool = True,
) -> list[torch.Tensor]:
    """``[replicas[i](*inputs[i]) for i ...]``, each forward in a thread of its own.

    Like ``nn.DataParallel``, one Python process drives every replica: with ``threads=True`` the
    forwards overlap as far as the GIL allows (on GPUs, while one thread waits for its kernels,
    another launches its own); ``threads=False`` runs them one after another, in order. Uses the
    first ``len(inputs)`` replicas. An exception in a replica is raised here, naming it.
    Chapters 2 and 3.
    """
    if len(inputs) > len(replicas):
        raise ValueError(f"{len(inputs)} inputs but only {len(replicas)} replicas")
    jobs = list(zip(replicas, inputs, strict=False))
    results: list = [None] * len(jobs)
    # Grad mode is a thread-local setting: the worker threads must inherit the caller's.
    grad_enabled = torch.is_grad_enabled()

    def work(i: int) -> None:
        replica, args = jobs[i]
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = replica(*args)
        except BaseException as exc:  # handed to the caller below
            results[i] = exc

    if threads and len(jobs) > 1:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        for i in range(len(jobs)):
            work(i)
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            raise RuntimeError(f"replica {i} failed in its forward pass: {result!r}") from result
    return results


def gather(outputs: Sequence[torch.Tensor], device: Device) -> torch.Tensor:
    """The replicas' outputs concatenated along dim 0 on ``device`` (differentiable: the backward
    pass sends each replica the gradient of its own rows). Chapters 2 and 3."""
    if not outputs:
        raise ValueError("no outputs to gather")
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        raise TypeError("gather expects one tensor per replica (a model returning one tensor)")
    return torch.cat([o.to(device) for o in outputs])
