"""When does data parallelism scale? The step-time model.

One data-parallel step is the compute of one rank plus the part of the gradient all-reduce that
does not overlap with it; the all-reduce costs what the alpha-beta model of chapter 6
(:func:`dpcourse.cost.costmodel.all_reduce_time`) says. From it come weak and strong scaling
efficiency and the largest world size that keeps an efficiency target. The hardware figures
(:mod:`dpcourse.cost.hardware`) are published peak numbers, quoted with their sources; everything
computed from them is a
*model*, not a measurement. Tested in ``tests/test_scaling.py``.

The chapter's other two parts live elsewhere: the gradient noise scale and steps to a target in
:mod:`dpcourse.cost.noise_scale`, the measured DDP steps in :mod:`dpcourse.harness.bench.scaling`.

Chapter 10: the step-time model of data-parallel training and its efficiency.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from dpcourse.cost import costmodel
from dpcourse.cost.hardware import GPU, H100, IB_NDR, NVLINK4, Link

__all__ = [
    "training_flops",
    "compute_time",
    "gradient_bytes",
    "bucket_count",
    "cross_node_link",
    "flat_all_reduce_time",
    "hierarchical_all_reduce_time",
    "overlapped_step_time",
    "step_time",
    "efficiency",
    "largest_world_size",
    "tokens_to_hide",
    "BACKWARD_FRACTION",
]

# Backward costs about twice the forward (a gradient for the weights and one for the inputs),
# so it is about 2/3 of a step's compute: the part bucketed DDP can hide all-reduces behind.
BACKWARD_FRACTION = 2.0 / 3.0


def training_flops(num_params: float, tokens: float) -> float:
    """FLOPs of one training step of a dense Transformer: ``6 * params * tokens`` (2 for the
    forward, 4 for the backward; Kaplan et al., 2020), attention's extra FLOPs left out."""
    return 6.0 * num_params * tokens


def compute_time(num_params: float, tokens: float, gpu: GPU = H100, mfu: float = 0.4) -> float:
    """Seconds of compute for one step on one GPU at model-FLOPs utilisation ``mfu``."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu is a fraction of the peak, in (0, 1]; got {mfu}")
    return training_flops(num_params, tokens) / (gpu.peak_flops * mfu)


def gradient_bytes(num_params: float, dtype: torch.dtype | str = "bf16") -> float:
    """Bytes of one full gradient: 2 per parameter in bf16/fp16, 4 in fp32."""
    size = {"bf16": 2, "fp16": 2, "fp32": 4}.get(dtype) if isinstance(dtype, str) else None
    if size is None:
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"dtype must be 'bf16', 'fp16', 'fp32' or a torch dtype; got {dtype!r}"
            )
        size = torch.empty((), dtype=dtype).element_size()
    return float(num_params) * size


def bucket_count(
    grad_bytes: float, bucket_cap_bytes: float = 25 * 2**20, first_bucket_bytes: float = 0.0
) -> int:
    """How many all-reduces DDP launches for ``grad_bytes`` of gradients in buckets of at most
    ``bucket_cap_bytes`` (DDP's default cap is 25 MiB). PyTorch's DDP makes its first bucket
    smaller (1 MiB) so that the first all-reduce starts early: pass ``first_bucket_bytes=2**20``
    to count it. Bytes only: DDP never splits a parameter, so real buckets can be a little fuller.
    """
    if bucket_cap_bytes <= 0 or first_bucket_bytes < 0:
        raise ValueError(
            f"bucket sizes must be positive, got {bucket_cap_bytes} and {first_bucket_bytes}"
        )
    if first_bucket_bytes and grad_bytes > first_bucket_bytes:
        return 1 + math.ceil((grad_bytes - first_bucket_bytes) / bucket_cap_bytes)
    return max(1, math.ceil(grad_bytes / bucket_cap_bytes))


# ------------------------------------------------------------------------------ the model


def cross_node_link(rings: int = 8, inter: Link = IB_NDR, intra: Link = NVLINK4) -> Link:
    """The link a flat ring across nodes runs at when it is ``rings`` rings side by side, each
    with 1/rings of the data and crossing between nodes through its own network card of
    ``inter`` (NCCL's channels, one per card). A step waits for the slower of a card, which
    carries 1/rings of a GPU's traffic, and NVLink (``intra``), which carries at most all of it:
    beta = min(rings x inter.beta, intra.beta); the latency is the card's, paid once since the
    rings run in parallel. 8 rings on H100 nodes: 400 GB/s, the node's 8 cards. ``rings=1``, one
    ring through one card, is the pessimistic bound. Chapter 10."""
    if not isinstance(rings, (int, np.integer)) or rings < 1:
        raise ValueError(f"rings must be a positive integer, got {rings!r}")
    card = inter.name.split(",")[0]
    name = (f"{rings} rings across nodes, each through its own {card} card" if rings > 1
            else f"one ring across nodes through one {card} card")
    return Link(name, inter.alpha, min(rings * inter.beta, intra.beta),
                f"{rings} x {inter.beta / 1e9:g} GB/s, at most NVLink's {intra.beta / 1e9:g}")


def flat_all_reduce_time(
    grad_bytes: float,
    world_size: int,
    gpus_per_node: int = 8,
    intra: Link = NVLINK4,
    inter: Link = IB_NDR,
    buckets: int = 1,
    rings: int | None = None,
) -> float:
    """Modelled flat ring all-reduce over ``world_size`` GPUs: within one node a ring on
    ``intra``; across nodes ``rings`` rings side by side on :func:`cross_node_link`. By default
    one ring per GPU of the node, each through that GPU's card (a DGX H100 has a card per GPU);
    ``rings=1`` is the pessimistic bound of one ring through one card. Chapter 10."""
    if world_size <= gpus_per_node:
        link = intra
    else:
        link = cross_node_link(gpus_per_node if rings is None else rings, inter, intra)
    return costmodel.all_reduce_time("ring", world_size, grad_bytes, link.alpha, link.beta,
                                     buckets)


def hierarchical_all_reduce_time(
    grad_bytes: float,
    world_size: int,
    gpus_per_node: int = 8,
    intra: Link = NVLINK4,
    inter: Link = IB_NDR,
    buckets: int = 1,
) -> float:
    """Modelled two-level all-reduce over ``world_size / gpus_per_node`` nodes: a ring
    reduce-scatter inside each node (NVLink), then ``gpus_per_node`` ring all-reduces in
    parallel across nodes, each of 1/g of the data over its own GPU's NIC, then an all-gather
    inside the node. With one node it is a ring on ``intra``; with one GPU per node a ring on
    ``inter``. ``world_size`` must be below or a multiple of ``gpus_per_node``."""
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    g = min(gpus_per_node, int(world_size))
    if world_size % g:
        raise ValueError(
            f"world_size {world_size} is not a multiple of gpus_per_node {gpus_per_node}"
        )
    nodes = int(world_size) // g
    inside = costmodel.all_reduce_time("ring", g, grad_bytes, intra.alpha, intra.beta, buckets)
    across = costmodel.all_reduce_time(
        "ring", nodes, grad_bytes / g, inter.alpha, inter.beta, buckets
    )
    return inside + across


def overlapped_step_time(compute_s: float, comm_s: float, overlap: float = 0.0) -> float:
    """Seconds of a step whose all-reduce of ``comm_s`` seconds can run behind the fraction
    ``overlap`` of its ``compute_s``: ``compute + max(0, comm - overlap * compute)``. For any
    all-reduce model (the flat ring of :func:`step_time`, the two-level one of
    :func:`hierarchical_all_reduce_time`)."""
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap is a fraction of the compute, in [0, 1]; got {overlap}")
    return compute_s + max(0.0, comm_s - overlap * compute_s)


def step_time(
    world_size: int,
    compute_s: float,
    grad_bytes: float,
    alpha: float,
    beta: float,
    overlap: float = 0.0,
    buckets: int = 1,
) -> float:
    """Modelled seconds of one data-parallel step: ``compute_s`` (one rank's forward, backward
    and update) plus the ring all-reduce time that is not hidden behind compute.

    ``overlap`` is the fraction of the compute the all-reduce can run behind: 0 when it starts
    after backward, about :data:`BACKWARD_FRACTION` (2/3) for bucketed DDP, which overlaps it
    with backward, 1 in the ideal limit. So ``step = compute + max(0, comm - overlap*compute)``.
    """
    comm = costmodel.all_reduce_time("ring", world_size, grad_bytes, alpha, beta, buckets)
    return overlapped_step_time(compute_s, comm, overlap)


def efficiency(
    world_size: int,
    compute_s: float,
    grad_bytes: float,
    alpha: float,
    beta: float,
    overlap: float = 0.0,
    buckets: int = 1,
    mode: str = "weak",
) -> float:
    """Modelled scaling efficiency: throughput on ``world_size`` ranks over ``world_size`` times
    the throughput of one rank (1 means perfect scaling).

    ``mode="weak"``: the batch per rank is fixed (the global batch grows with N); ``compute_s``
    is one rank's compute, the same at every N, and the efficiency is ``compute_s / step``.
    ``mode="strong"``: the global batch is fixed; ``compute_s`` is the compute of the whole
    batch on one rank, each of N ranks does ``compute_s / N``, and the efficiency is
    ``compute_s / (N * step)``.
    """
    if mode == "weak":
        per_rank = compute_s
    elif mode == "strong":
        per_rank = compute_s / world_size
    else:
        raise ValueError(f"mode must be 'weak' or 'strong', got {mode!r}")
    step = step_time(world_size, per_rank, grad_bytes, alpha, beta, overlap, buckets)
    return per_rank / step


def tokens_to_hide(
    comm_s: float,
    num_params: float,
    gpu: GPU = H100,
    mfu: float = 0.4,
    overlap: float = BACKWARD_FRACTION,
) -> float:
    """The fewest tokens per GPU per step whose compute hides an all-reduce of ``comm_s``
    seconds: the T at which ``overlap`` x :func:`compute_time` (num_params, T) equals
    ``comm_s`` (compute is linear in the tokens). Pass ``comm_s`` from
    :func:`dpcourse.cost.costmodel.all_reduce_time` or :func:`hierarchical_all_reduce_time` of
    :func:`gradient_bytes`. For a ring of N GPUs on links of bandwidth beta, bf16 gradients
    and the latency left out, T* = 2(N-1)/N x 2 bytes x F x MFU / (6 x overlap x beta): with
    MFU 1 and overlap 2/3, (N-1)/N x F / beta, the compute-bound batch of *How to Scale Your
    Model* without its (N-1)/N (its H100 figure: 990e12 / 450e9 = 2,200 tokens per GPU).
    Chapter 10."""
    if not 0 < overlap <= 1:
        raise ValueError(f"overlap is a fraction of the compute, in (0, 1]; got {overlap}")
    return comm_s / (overlap * compute_time(num_params, 1.0, gpu, mfu))


def largest_world_size(
    target: float, efficiency_at: Callable[[int], float], limit: int = 2**24
) -> int:
    """The largest N in [1, limit] with ``efficiency_at(N) >= target``, for an efficiency that
    does not grow with N (true of :func:`efficiency` for the ring: its latency and bandwidth
    terms both grow with N). Bisection, so it costs about log2(limit) calls. Returns 0 if even
    N = 1 misses the target."""
    if efficiency_at(1) < target:
        return 0
    if efficiency_at(limit) >= target:
        return limit
    lo, hi = 1, limit  # efficiency_at(lo) >= target > efficiency_at(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if efficiency_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo
