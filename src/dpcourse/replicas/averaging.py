"""Naive gradient averaging through a master copy on the CPU, as a parameter server does it.

Chapter 4, sections 4.1-4.4. Each replica runs forward and backward on its own shard, with its
own mean loss (the way DistributedDataParallel will in chapter 7); then the gradients travel to
the master, are averaged there and travel back, and every replica takes the same optimizer
step::

    losses = local_backward(replicas, shards, loss_fn)   # per replica: loss, backward
    average_gradients(replicas, weights=sizes)           # device -> CPU -> average -> device
    for opt in optimizers:                               # identical steps: replicas stay equal
        opt.step()

:func:`average_gradients` counts the bytes it moves and the time it takes (:class:`Traffic`), so
the chapter can show that a single master's load grows with the number of replicas. The two
ways of going wrong that the chapter measures have modules of their own: averaging parameters
every ``k`` steps instead of gradients every step (:mod:`dpcourse.replicas.parameter_averaging`,
4.5),
and BatchNorm, whose statistics depend on the split (:mod:`dpcourse.replicas.replica_batchnorm`,
4.6).

Chapter 4: naive gradient averaging.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dpcourse import runtime
from dpcourse.replicas.replication import (
    create_replicas,
    devices_for,
    module_device,
    replica_devices,
)
from dpcourse.replicas.scatter_gather import chunk_data

__all__ = [
    "Traffic",
    "local_backward",
    "shard_weights",
    "split_by_fractions",
    "average_gradients",
    "measure_averaging",
    "Run",
    "train_gradient_averaging",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
MakeOptimizer = Callable[[object], torch.optim.Optimizer]


@dataclass
class Traffic:
    """What went through the master: bytes received from the replicas, bytes sent back to them,
    and the seconds it took. Added to by every call it is passed to."""

    bytes_to_master: int = 0
    bytes_from_master: int = 0
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return self.bytes_to_master + self.bytes_from_master


# ----------------------------------------------------------------------------- the shards
def local_backward(
    replicas: Sequence[nn.Module], shards: Sequence[Sequence[torch.Tensor]], loss_fn: LossFn
) -> list[float]:
    """Forward and backward on every replica with its own shard; returns each shard's loss.

    ``shards[i]`` is ``(inputs..., target)`` for ``replicas[i]`` (moved to its device here). Each
    replica's gradients are zeroed first, then set to the gradient of *its shard's* mean loss:
    nothing is shared yet. Chapter 4.
    """
    devices = replica_devices(replicas)
    if len(shards) != len(replicas):
        raise ValueError(f"{len(shards)} shards for {len(replicas)} replicas: give one each")
    losses = []
    for replica, shard, device in zip(replicas, shards, devices, strict=True):
        *inputs, target = (t.to(device) for t in shard)
        if len(target) == 0:
            raise ValueError("a shard is empty: every replica needs at least one sample")
        replica.zero_grad(set_to_none=True)
        loss = loss_fn(replica(*inputs), target)
        loss.backward()
        losses.append(loss.item())
    return losses


def shard_weights(sizes: Sequence[int]) -> list[float]:
    """``[B_i / B]``: the share of the batch each shard holds, the weights that make an average
    of per-shard mean gradients equal to the gradient of the whole batch's mean loss."""
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"shard sizes must all be positive, got {list(sizes)}")
    total = sum(sizes)
    return [s / total for s in sizes]


def split_by_fractions(
    batch: Sequence[torch.Tensor], fractions: Sequence[float]
) -> list[tuple[torch.Tensor, ...]]:
    """Split ``(inputs..., target)`` along dim 0 into uneven shards, e.g. 25/25/10/40 %.

    ``fractions`` are positive and add up to 1; shard sizes are ``round(f * B)``, corrected
    (largest remainders first) so they add up to ``B``. Raises ``ValueError`` if a shard would be
    empty. Chapter 4's uneven shards.
    """
    if not fractions or any(f <= 0 for f in fractions) or not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"fractions must be positive and add up to 1, got {list(fractions)}")
    size = len(batch[0])
    exact = [f * size for f in fractions]
    sizes = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: sizes[i] - exact[i])
    for i in by_remainder[: size - sum(sizes)]:
        sizes[i] += 1
    if min(sizes) < 1:
        raise ValueError(
            f"a batch of {size} split {list(fractions)} leaves a shard empty ({sizes}): "
            "use a larger batch"
        )
    return [tuple(p) for p in zip(*(t.split(sizes) for t in batch), strict=True)]


# ------------------------------------------------------------------- through the master
def replica_weights(weights: Sequence[float] | None, n: int, op: str) -> list[float]:
    """Each replica's weight in an average (``op="mean"``) or a sum: given, or equal."""
    if op not in ("mean", "sum"):
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    if weights is None:
        return [1.0 / n] * n if op == "mean" else [1.0] * n
    if op == "sum":
        raise ValueError("weights go with op='mean' (a weighted mean); op='sum' adds as they are")
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} replicas: give one per replica")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative and not all zero, got {list(weights)}")
    total = float(sum(weights))
    return [w / total for w in weights]


def tensor_columns(replicas: Sequence[nn.Module], what: str):
    """(name, [tensor of replica 0, of replica 1, ...]) for each parameter or buffer."""
    named = [dict(getattr(r, f"named_{what}")()) for r in replicas]
    for name in named[0]:
        yield name, [n[name] for n in named]


@torch.no_grad()
def average_gradients(
    replicas: Sequence[nn.Module],
    weights: Sequence[float] | None = None,
    op: str = "mean",
    master_device: torch.device | str = "cpu",
    traffic: Traffic | None = None,
    buffers: dict[str, torch.Tensor] | None = None,
) -> None:
    """Replace every replica's gradients by their average, computed on a master copy.

    For each trainable parameter the gradient of every replica is copied to ``master_device``
    (the CPU: device -> CPU), combined there, and the result copied back into each replica's
    ``.grad`` (CPU -> device): ``op="mean"`` takes ``sum_i w_i g_i / sum_i w_i`` (weights default to
    equal; pass the shard sizes for uneven shards), ``op="sum"`` takes ``sum_i g_i``. Frozen
    parameters are skipped, and so are parameters that no replica has a gradient for. A gradient
    missing on some replicas only is an error. If ``traffic`` is given, the bytes moved and the
    time taken are added to it. ``buffers`` (a dict, empty at first) keeps the master's tensors
    between calls, as a parameter server keeps its copy, so that repeated calls allocate nothing.
    Chapter 4.
    """
    devices = replica_devices(replicas)  # each replica on one device, all alike, or an error
    w = replica_weights(weights, len(replicas), op)
    master_device = torch.device(master_device)
    buffers = {} if buffers is None else buffers
    start = time.perf_counter()
    received = sent = 0
    for name, params in tensor_columns(replicas, "parameters"):
        if not params[0].requires_grad:
            continue
        missing = [i for i, p in enumerate(params) if p.grad is None]
        if len(missing) == len(params):
            continue
        if missing:
            raise ValueError(
                f"replica(s) {missing} have no gradient for {name!r} but others do: run "
                "backward on every replica (local_backward) before averaging"
            )
        # The master receives each gradient into a tensor of its own (as a separate machine
        # would), even when a "device" is the CPU itself, and adds it to the running total.
        grad = params[0].grad
        if name not in buffers:
            buffers[name] = torch.empty_like(grad, device=master_device)
            buffers[name + "/received"] = torch.empty_like(grad, device=master_device)
        total, inbox = buffers[name], buffers[name + "/received"]
        total.zero_()
        for wi, p in zip(w, params, strict=True):
            inbox.copy_(p.grad)  # device -> master
            total.add_(inbox, alpha=wi)
            received += p.grad.nbytes
        for p in params:
            p.grad.copy_(total)  # master -> device
            sent += total.nbytes
    for d in set(devices):
        runtime.synchronize(d)
    if traffic is not None:
        traffic.bytes_to_master += received
        traffic.bytes_from_master += sent
        traffic.seconds += time.perf_counter() - start


def measure_averaging(model: nn.Module, n: int, repeats: int = 5) -> Traffic:
    """Average random gradients over ``n`` replicas of ``model`` (on ``devices_for(n)``) through a
    CPU master ``repeats`` times; returns the bytes of one averaging and its shortest time (the
    cost without interference from whatever else the machine is doing). Chapter 4 plots both
    against ``n``."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    replicas = create_replicas(model, devices_for(n))
    for r in replicas:
        for p in r.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
    times, one, buffers = [], Traffic(), {}
    # One intra-op thread, as one server thread would do it: a pool of threads waiting for each
    # other on a busy machine would measure the machine's load rather than the copies.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        average_gradients(replicas, buffers=buffers)  # a first call allocates the master's copy
        for k in range(repeats):
            traffic = Traffic()
            average_gradients(replicas, traffic=traffic, buffers=buffers)
            times.append(traffic.seconds)
            if k == 0:
                one = traffic
    finally:
        torch.set_num_threads(threads)
    one.seconds = min(times)
    return one


# ------------------------------------------------------------------------------- training
@dataclass
class Run:
    """A data-parallel training run: ``losses[j]`` is the loss on the evaluation batch after
    ``steps[j]`` steps (``steps[0] == 0``: before training); ``model`` is the final model (for
    parameter averaging, the average of the replicas)."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    model: nn.Module | None = None


@torch.no_grad()
def evaluate_loss(model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: LossFn) -> float:
    """The loss of ``model`` on ``batch`` (inputs..., target), moved to the model's device."""
    device = module_device(model)
    *inputs, target = (t.to(device) for t in batch)
    return loss_fn(model(*inputs), target).item()


def batch_shards(batch: Sequence[torch.Tensor], n: int, fractions: Sequence[float] | None) -> list:
    """``batch`` cut into ``n`` shards: even chunks, or of the given ``fractions``."""
    if fractions is None:
        shards = chunk_data(tuple(batch), n)
        if len(shards) != n:
            raise ValueError(f"a batch of {len(batch[0])} makes only {len(shards)} chunks for {n}")
        return shards
    if len(fractions) != n:
        raise ValueError(f"{len(fractions)} fractions for {n} replicas")
    return split_by_fractions(batch, fractions)


def train_gradient_averaging(
    model: nn.Module,
    batches: Sequence[Sequence[torch.Tensor]],
    n: int,
    loss_fn: LossFn,
    make_optimizer: MakeOptimizer,
    eval_batch: Sequence[torch.Tensor],
    fractions: Sequence[float] | None = None,
    weighting: str = "size",
    op: str = "mean",
) -> Run:
    """Synchronous data parallelism: every step, each of ``n`` replicas takes its shard of the
    step's batch, and gradients are averaged through the CPU master before the update.

    Shards are :func:`~dpcourse.replicas.scatter_gather.chunk_data`'s, or uneven ones by
    ``fractions``.
    ``weighting="size"`` weighs each shard's gradient by its size (equal to one device on the
    whole batch), ``"equal"`` takes the plain mean. The loss on ``eval_batch`` is recorded after
    every step. ``model`` is not changed. Chapter 4.
    """
    if weighting not in ("size", "equal"):
        raise ValueError(f"weighting must be 'size' or 'equal', got {weighting!r}")
    replicas = create_replicas(model, devices_for(n))
    optimizers = [make_optimizer(r.parameters()) for r in replicas]
    run = Run(steps=[0], losses=[evaluate_loss(replicas[0], eval_batch, loss_fn)])
    for step, batch in enumerate(batches, start=1):
        shards = batch_shards(batch, n, fractions)
        local_backward(replicas, shards, loss_fn)
        sizes = [len(s[-1]) for s in shards]
        weights = sizes if weighting == "size" and op == "mean" else None
        average_gradients(replicas, weights=weights, op=op)
        for opt in optimizers:
            opt.step()
        run.steps.append(step)
        run.losses.append(evaluate_loss(replicas[0], eval_batch, loss_fn))
    run.model = replicas[0]
    return run

