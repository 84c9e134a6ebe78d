"""BatchNorm under data parallelism: every replica normalises with its own chunk's statistics.

Chapter 4, section 4.6. A BatchNorm layer in training mode normalises with the mean and variance
of the batch it sees; ``n`` replicas each see a chunk, so each normalises differently from one
device on the whole batch, and no gradient averaging makes up for it (chapter 8's SyncBatchNorm
does). :func:`batchnorm_statistics` measures both, layer by layer.

Chapter 4: naive gradient averaging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dpcourse.replicas.replication import create_replicas, module_device
from dpcourse.replicas.scatter_gather import chunk_data

__all__ = ["BatchNormStats", "batchnorm_statistics"]


@dataclass
class BatchNormStats:
    """The batch statistics one BatchNorm layer normalises with: per channel, over the whole
    batch (``whole_mean``, ``whole_var``: shape ``(C,)``) and over each replica's chunk
    (``replica_means``, ``replica_vars``: shape ``(n, C)``). Variances are biased, as BatchNorm
    uses them to normalise."""

    layer: str
    whole_mean: torch.Tensor
    whole_var: torch.Tensor
    replica_means: torch.Tensor
    replica_vars: torch.Tensor


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@torch.no_grad()
def _bn_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    layers = {name: m for name, m in model.named_modules() if isinstance(m, _BATCH_NORMS)}
    if not layers:
        raise ValueError(f"{type(model).__name__} has no BatchNorm layer")
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str):
        def record(_module, args):
            (inp,) = args
            dims = [d for d in range(inp.dim()) if d != 1]  # every dimension but the channels
            stats[name] = (inp.mean(dims), inp.var(dims, unbiased=False))

        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return stats


def batchnorm_statistics(model: nn.Module, x: torch.Tensor, n: int) -> list[BatchNormStats]:
    """What each BatchNorm layer of ``model`` normalises with in training mode, on the whole batch
    ``x`` and on each of its ``n`` chunks (as ``n`` replicas would see them); one
    :class:`BatchNormStats` per layer, in order. Runs on a copy in training mode, so ``model`` and
    its running statistics are not changed. Chapter 4 (SyncBatchNorm comes in chapter 8)."""
    (replica,) = create_replicas(model, [module_device(model)])
    replica.train()
    whole = _bn_inputs(replica, x)
    per_chunk = [_bn_inputs(replica, chunk) for chunk in chunk_data(x, n)]
    return [
        BatchNormStats(
            layer=name,
            whole_mean=mean.cpu(),
            whole_var=var.cpu(),
            replica_means=torch.stack([c[name][0] for c in per_chunk]).cpu(),
            replica_vars=torch.stack([c[name][1] for c in per_chunk]).cpu(),
        )
        for name, (mean, var) in whole.items()
    ]
