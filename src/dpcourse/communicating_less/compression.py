"""Gradients compressed to 16 bits inside DDP's buckets: communication hooks, as torch's.

A DDP communication hook replaces a bucket's all-reduce: DDP calls ``hook(state, bucket)`` as
soon as the bucket is full and waits for the ``torch.futures.Future`` it returns, whose value is
the bucket's averaged gradients. :func:`compress_hook` casts the bucket to a 16-bit dtype,
divides it by the world size first (fp16 overflows at 65,504: the sum of N gradients is the
risk, not one), all-reduces the half-size tensor and casts the result back into the bucket::

    ddp.register_comm_hook(None, fp16_compress_hook)    # torch's DDP or dpcourse.ddp.DDP

Half the bytes on the wire for every bucket; the price is the rounding, 2^-11 of each value
in fp16 and 2^-8 in bf16, which does not add up over steps as long as it is unbiased (and
fp16's underflow below 6e-8, which bf16 does not have). :func:`allreduce_hook` is the hook that
does what DDP does without one. ``tests/test_communicating_less.py`` checks each against torch's
``default_hooks`` on the same buckets, on 2 to 4 ranks.

torch's DDP reads a hook's annotations (``bucket: dist.GradBucket``, the return a
``Future[Tensor]``) and refuses others: they are evaluated here, not strings.

Chapter 12: compressed gradients as DDP communication hooks.
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.ddp.buckets import Bucket, HookBucket

__all__ = ["allreduce_hook", "compress_hook", "fp16_compress_hook", "bf16_compress_hook",
           "bucket_of"]


def allreduce_hook(process_group: dist.ProcessGroup | None,
                   bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook that changes nothing: the bucket divided by the world size and all-reduced
    (what DDP does without a hook). ``process_group=None`` is the default group."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(process_group))
    fut = dist.all_reduce(buffer, group=process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None,
    bucket: dist.GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """The bucket all-reduced in ``dtype`` (``torch.float16`` or
    ``torch.bfloat16``): cast, divided by the world size, summed, and cast
    back into the bucket when the Future completes. The bucket is a flat
    tensor on the model's device; the all-reduce sends half its bytes."""
    buffer = bucket.buffer()
    world = dist.get_world_size(process_group)
    compressed = buffer.to(dtype).div_(world)  # divide first

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # back to fp32, in the bucket itself
        return buffer

    work = dist.all_reduce(compressed, group=process_group, async_op=True)
    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`compress_hook` in fp16 (torch's ``default_hooks.fp16_compress_hook``)."""
    return compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: dist.ProcessGroup | None,
                       bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`compress_hook` in bf16 (torch's ``default_hooks.bf16_compress_hook``)."""
    return compress_hook(torch.bfloat16, process_group, bucket)


def bucket_of(gradients: Sequence[torch.Tensor], index: int = 0, count: int = 1) -> HookBucket:
    """A bucket holding a copy of ``gradients`` (one flat tensor, in order), as a hook sees it:
    for calling a hook outside DDP, as chapter 12 does to compare ours with torch's on the same
    buckets. ``index`` and ``count`` say which of how many buckets it is (PowerSGD counts its
    steps by the last)."""
    params = [nn.Parameter(g.new_empty(g.shape)) for g in gradients]  # shapes, for the views
    offsets = [0]
    for g in gradients[:-1]:
        offsets.append(offsets[-1] + g.numel())
    buffer = torch.cat([g.reshape(-1) for g in gradients]).clone()
    return HookBucket(Bucket(index, params, offsets, buffer), count)
