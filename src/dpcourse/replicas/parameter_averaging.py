"""Parameter averaging (local SGD): replicas train alone for ``k`` steps, then average weights.

Chapter 4, section 4.5. Instead of averaging gradients through the master at every step (as
:mod:`dpcourse.replicas.averaging` does), each replica takes ``k`` optimizer steps on its own
shards and then the replicas' parameters are averaged through the CPU master::

    for step, batch in enumerate(batches, start=1):
        local_backward(replicas, shards, loss_fn)          # each replica alone
        for opt in optimizers:
            opt.step()
        if step % k == 0:
            average_parameters(replicas)                   # device -> CPU -> mean -> device

With plain SGD and ``k = 1`` this is gradient averaging exactly; as ``k`` grows it drifts away.

Chapter 4: naive gradient averaging.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from dpcourse.replicas.averaging import (
    LossFn,
    MakeOptimizer,
    Run,
    Traffic,
    batch_shards,
    evaluate_loss,
    local_backward,
    replica_weights,
    tensor_columns,
)
from dpcourse.replicas.replication import create_replicas, devices_for, replica_devices

__all__ = ["average_parameters", "train_parameter_averaging"]


@torch.no_grad()
def average_parameters(
    replicas: Sequence[nn.Module],
    weights: Sequence[float] | None = None,
    master_device: torch.device | str = "cpu",
    traffic: Traffic | None = None,
) -> None:
    """Set every replica's parameters and floating-point buffers to their (weighted) mean over
    the replicas, computed on ``master_device``; integer buffers (BatchNorm's batch counter) are
    taken from replica 0. The step of parameter averaging (local SGD), chapter 4."""
    devices = replica_devices(replicas)
    w = replica_weights(weights, len(replicas), "mean")
    start = time.perf_counter()
    received = sent = 0
    for what in ("parameters", "buffers"):
        for _, tensors in tensor_columns(replicas, what):
            if tensors[0].is_floating_point():
                mean = torch.zeros_like(tensors[0], device=master_device)
                for wi, t in zip(w, tensors, strict=True):
                    mean.add_(t.to(master_device, copy=True), alpha=wi)
                    received += t.nbytes
            else:  # every replica sends its counter; the master keeps replica 0's
                mean = tensors[0].to(master_device, copy=True)
                received += sum(t.nbytes for t in tensors)
            for t, d in zip(tensors, devices, strict=True):
                t.copy_(mean.to(d))
                sent += mean.nbytes
    if traffic is not None:
        traffic.bytes_to_master += received
        traffic.bytes_from_master += sent
        traffic.seconds += time.perf_counter() - start


def train_parameter_averaging(
    model: nn.Module,
    batches: Sequence[Sequence[torch.Tensor]],
    n: int,
    loss_fn: LossFn,
    make_optimizer: MakeOptimizer,
    eval_batch: Sequence[torch.Tensor],
    k: int,
) -> Run:
    """Parameter averaging (local SGD): each of ``n`` replicas trains alone on its shards of the
    batches for ``k`` steps, then their parameters are averaged through the CPU master.

    Each replica keeps its own optimizer (its state is not averaged). The loss on ``eval_batch``
    of the averaged model is recorded after every averaging, and after the last step (which
    averages too). With plain SGD and ``k=1`` this is gradient averaging exactly (the average of
    ``w - lr g_i`` is ``w - lr mean(g_i)``); as ``k`` grows it drifts away. Chapter 4.
    """
    if k < 1:
        raise ValueError(f"k (steps between averagings) must be at least 1, got {k}")
    replicas = create_replicas(model, devices_for(n))
    optimizers = [make_optimizer(r.parameters()) for r in replicas]
    run = Run(steps=[0], losses=[evaluate_loss(replicas[0], eval_batch, loss_fn)])
    for step, batch in enumerate(batches, start=1):
        local_backward(replicas, batch_shards(batch, n, None), loss_fn)
        for opt in optimizers:
            opt.step()
        if step % k == 0 or step == len(batches):
            average_parameters(replicas)
            run.steps.append(step)
            run.losses.append(evaluate_loss(replicas[0], eval_batch, loss_fn))
    run.model = replicas[0]
    return run
