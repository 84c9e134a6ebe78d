"""Gradient buckets: the part of DDP that groups gradients and launches their all-reduces.

:func:`bucket_assignment` groups parameters, in reverse registration order, into buckets that
close once they reach ``cap_bytes`` (torch's rule); a :class:`Bucket` is one flat tensor whose
slices *are* the parameters' ``.grad`` (like torch's ``gradient_as_bucket_view=True``);
:class:`BucketManager`, the reducer, counts the gradients as they arrive and launches one
asynchronous all-reduce per full bucket, in bucket order. :class:`dpcourse.ddp.ddp.DDP` drives it
from autograd hooks. The split follows picotron's ``data_parallel.py`` / ``bucket.py``; the
names follow PyTorch's DDP design note.

A parameter without a gradient on this rank takes part in its bucket's all-reduce as zeros, which
plain SGD ignores but momentum, Adam or weight decay do not. torch's
``find_unused_parameters=True``, which gives a parameter that no rank used its gradient back as it
was, is a layer on this reducer: :class:`dpcourse.ddp.unused.KeepUnused`.

What is not here: torch's smaller first bucket (1 MiB, so that communication starts early), the
bucket order rebuilt after the first step from the order gradients arrived in. Communication hooks
(torch's ``register_comm_hook``: what replaces a bucket's all-reduce, chapter 12's compression)
are a layer on top: :class:`HookedBucketManager` takes over a reducer's buckets and launches a
hook instead, handing it a :class:`HookBucket`, the interface of torch's ``dist.GradBucket``.

Chapter 7: gradient buckets for DistributedDataParallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["MB", "bucket_assignment", "Bucket", "HookBucket", "BucketManager",
           "HookedBucketManager"]

MB = 2**20  # bucket_cap_mb counts mebibytes, as torch's DDP does


def bucket_assignment(param_bytes: Sequence[int],
                      cap_bytes: float) -> list[list[int]]:
    """Group parameters into buckets: ``param_bytes[i]`` is parameter i's
    gradient size in bytes, in registration order; returns lists of indices,
    first bucket first.

    Buckets are filled in *reverse* registration order, because backward
    produces the last layer's gradients first. A bucket takes parameters
    until its size reaches ``cap_bytes``: the parameter that brings it to
    the cap or past it is its last. This is torch's rule
    (``torch.distributed._compute_bucket_assignment_by_size``, which
    ``tests/test_ddp.py`` compares against), so a bucket can exceed the cap
    by less than its last parameter, and a parameter larger than the cap
    closes the bucket it joins. ``cap_bytes=0`` gives one bucket per
    parameter. Chapter 7.
    """
    if cap_bytes < 0:
        raise ValueError("the bucket cap must be 0 or more bytes, "
                         f"got {cap_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(param_bytes))):
        current.append(i)
        size += param_bytes[i]
        if size >= cap_bytes:  # full: the next parameter starts another
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(eq=False)
class Bucket:
    """Gradients that travel together: one flat tensor ``buffer`` whose slices are the
    ``params``' gradients (``offsets[i]`` is where ``params[i]`` starts)."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    ready: list[bool] = field(default_factory=list)  # which gradients arrived this step
    pending: int = 0  # gradients still to come in this step
    work: dist.Work | None = None  # the all-reduce in flight, if launched

    def __post_init__(self) -> None:
        self.views = [
            self.buffer[o : o + p.numel()].view_as(p)
            for p, o in zip(self.params, self.offsets, strict=True)
        ]
        self.reset()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def take_gradient(self, i: int) -> None:
        """Make ``params[i].grad`` a view of this bucket, copying it in if autograd put it in
        a tensor of its own (after ``zero_grad(set_to_none=True)``); zeros if there is none."""
        p, view = self.params[i], self.views[i]
        if p.grad is None:
            view.zero_()
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view


class HookBucket:
    """A :class:`Bucket` as a communication hook sees it: the methods of torch's
    ``dist.GradBucket`` that hooks call (``buffer``, ``index``, ``is_last``, ``gradients``,
    ``parameters``, ``set_buffer``), so that one hook runs on torch's DDP and on ours
    (chapter 12)."""

    def __init__(self, bucket: Bucket, count: int) -> None:
        self._bucket, self._count, self._buffer = bucket, count, bucket.buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def index(self) -> int:
        return self._bucket.index

    def is_last(self) -> bool:
        return self._bucket.index == self._count - 1

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._bucket.params)


class BucketManager:
    """The reducer: puts parameters into buckets, counts the gradients that have arrived, and
    launches each bucket's all-reduce, in bucket order, once all its gradients are in.

    Buckets are launched strictly in index order on every rank: collectives are matched by
    the order in which ranks call them, so a rank that launched bucket 1 before bucket 0 would
    pair its bucket 1 with another rank's bucket 0.
    """

    def __init__(self, params: Sequence[nn.Parameter], cap_bytes: float, world_size: int) -> None:
        self.world_size = world_size
        self.buckets: list[Bucket] = []
        self.where: dict[nn.Parameter, tuple[Bucket, int]] = {}
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:  # a flat buffer holds one dtype
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            sizes = [p.numel() * p.element_size() for p in group]
            for indices in bucket_assignment(sizes, cap_bytes):
                members = [group[i] for i in indices]
                offsets = [sum(p.numel() for p in members[:k]) for k in range(len(members))]
                total = offsets[-1] + members[-1].numel()
                buffer = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
                bucket = Bucket(len(self.buckets), members, offsets, buffer)
                self.buckets.append(bucket)
                for k, p in enumerate(members):
                    self.where[p] = (bucket, k)
                    p.grad = bucket.views[k] if p.grad is None else p.grad
        self.next_to_launch = 0

    def mark_ready(self, param: nn.Parameter, launch: bool) -> None:
        """``param``'s gradient is complete: move it into its bucket, and if
        ``launch``, start every bucket that is now full and next in line."""
        bucket, k = self.where[param]
        bucket.ready[k] = True
        bucket.take_gradient(k)
        bucket.pending -= 1
        while launch and self.next_to_launch < len(self.buckets):
            if self.buckets[self.next_to_launch].pending:
                return  # the next bucket in line waits for a gradient
            self.launch(self.buckets[self.next_to_launch])

    def launch(self, bucket: Bucket) -> None:
        """Average ``bucket``'s gradients across the ranks: one asynchronous
        all-reduce."""
        bucket.buffer.div_(self.world_size)  # mean = sum of (gradient / N)
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self.next_to_launch = bucket.index + 1

    def finish(self) -> None:
        """Launch the buckets still waiting (a missing gradient counts as
        zeros), wait for every all-reduce, and start afresh for the next
        step."""
        for bucket in self.buckets[self.next_to_launch :]:
            for k, ready in enumerate(bucket.ready):
                if not ready:
                    bucket.take_gradient(k)  # zeros, or no_sync()'s sum
            self.launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.reset()
        self.next_to_launch = 0


class HookedBucketManager(BucketManager):
    """The reducer with a communication hook in place of each bucket's all-reduce, as torch's
    ``register_comm_hook`` (chapter 12): it takes over ``reducer``'s buckets and state, and
    launches ``hook(state, HookBucket)``, whose Future's value, the averaged gradients, is
    copied into the bucket where the hook left it elsewhere."""

    def __init__(self, reducer: BucketManager, hook, state: object) -> None:
        self.__dict__.update(reducer.__dict__)  # the same buckets, gradients and counters
        self.hook, self.state = hook, state

    def launch(self, bucket: Bucket) -> None:
        def into_bucket(fut: torch.futures.Future) -> torch.Tensor:
            value = fut.value()
            value = value[0] if isinstance(value, list) else value
            if value.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(value.view_as(bucket.buffer))
            return bucket.buffer

        fut = self.hook(self.state, HookBucket(bucket, len(self.buckets)))
        bucket.work = fut.then(into_bucket)
        self.next_to_launch = bucket.index + 1
