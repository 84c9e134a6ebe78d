"""Synchronised batch normalisation from scratch (chapter 8).

BatchNorm normalises with the mean and variance of the batch it sees. Under data parallelism each
rank sees B samples, not the N·B of the global batch, so plain BatchNorm computes different,
noisier statistics on every rank (chapter 4 measured it). SyncBatchNorm computes them over the
global batch with one all-reduce of three numbers per channel: the sum, the sum of squares and
the count of the rank's values. From those,

    mean = sum / count,    var = sumsq / count - mean²    (biased, used to normalise),

and the running variance uses the unbiased ``var * count / (count - 1)``, as BatchNorm does.

The backward pass needs the global batch too: the gradient of the input of a batch norm is

    dx = (dy - mean(dy) - x̂ · mean(dy · x̂)) · weight / sqrt(var + eps)

where the two means are over the *whole* batch: a second all-reduce, of ``sum(dy)`` and
``sum(dy · x̂)`` per channel. The weight and bias gradients are left as each rank's sums; the
gradient all-reduce of DDP (or of chapter 4's averaging) combines them like every other gradient.

``var = sumsq / count - mean²`` subtracts two large, nearly equal numbers when a channel's mean
is large against its spread, and float32 loses the variance (catastrophic cancellation).
``torch.nn.SyncBatchNorm`` instead all-gathers each rank's ``(mean, invstd, count)`` and combines
them with the parallel (Chan et al.) formula, :func:`stats_from_moments` here; the sums are kept
in :class:`SyncBatchNorm` because they are the simplest to read, and chapter 8 shows where they
fail. ``torch.nn.SyncBatchNorm`` runs (torch 2.13) only on CUDA/XPU tensors: on a CPU it
raises ``ValueError``. :class:`SyncBatchNorm` here works on any device and backend, and
``tests/test_practice.py`` checks it against ``BatchNorm`` on the concatenated batch: outputs,
running statistics and gradients.

Chapter 8: synchronised batch normalisation from scratch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "stats_from_sums",
    "stats_from_moments",
    "global_batch_stats",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
]


def _several_ranks() -> bool:
    """Whether a process group of more than one rank is there to sum the statistics over."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def stats_from_sums(
    total: torch.Tensor, total_sq: torch.Tensor, count: int | float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, biased var, unbiased var)`` per channel from the summed values, summed squares
    and count of the whole batch (all ranks'). Chapter 8's exercise asks for this function."""
    if float(count) < 2:
        raise ValueError(
            f"batch norm needs at least 2 values per channel over all ranks, got {count}"
        )
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0.0)  # rounding can make it slightly < 0
    return mean, var, var * count / (count - 1)


def stats_from_moments(
    means: torch.Tensor, variances: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, biased var, unbiased var)`` per channel of the whole batch from each rank's own
    ``means``, biased ``variances`` (both ``(world_size, C)``) and ``counts`` (``(world_size,)``):
    the parallel formula of Chan, Golub and LeVeque, which is what ``torch.nn.SyncBatchNorm``
    computes from its all-gathered statistics. With n = sum of the counts,

        mean = sum(n_r mean_r) / n,    var = sum(n_r (var_r + (mean_r - mean)²)) / n,

    the law of total variance: each rank's spread plus the spread of the ranks' means around the
    global one. Nothing large is subtracted, so it keeps float32's accuracy where
    :func:`stats_from_sums` cancels. Chapter 8."""
    counts = counts.to(means.dtype).reshape(-1, 1)
    n = counts.sum()
    if float(n) < 2:
        raise ValueError(f"batch norm needs at least 2 values per channel over all ranks, got {n}")
    mean = (counts * means).sum(0) / n
    var = (counts * (variances + (means - mean) ** 2)).sum(0) / n
    return mean, var, var * n / (n - 1)


def _per_channel(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sum and sum of squares over every dimension but the channel dimension 1."""
    dims = [0, *range(2, x.dim())]
    return x.sum(dims), (x * x).sum(dims)


def global_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean, biased var, unbiased var)`` of the channels of ``x`` (shape ``(B, C, ...)``) over
    the batches of all ranks: one all-reduce of ``[sum, sum of squares, count]`` (a no-op
    outside a process group). Ranks may hold batches of different sizes."""
    total, total_sq = _per_channel(x.detach().float())
    count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float32, device=x.device)
    packed = torch.cat([total, total_sq, count])  # one message instead of three
    if _several_ranks():
        dist.all_reduce(packed)
    c = x.shape[1]
    return stats_from_sums(packed[:c], packed[c : 2 * c], packed[-1].item())


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, mean, var, eps):
        shape = [1, -1] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + eps)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.count = x.numel() / x.shape[1]
        out = xhat
        if weight is not None:
            out = xhat * weight.view(shape) + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        shape = [1, -1] + [1] * (dy.dim() - 2)
        dims = [0, *range(2, dy.dim())]
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        c = dy.shape[1]
        packed = torch.cat([sum_dy, sum_dy_xhat, sum_dy.new_tensor([ctx.count])])
        if _several_ranks():
            dist.all_reduce(packed)  # the means in the gradient are over the global batch
        mean_dy = packed[:c] / packed[-1]
        mean_dy_xhat = packed[c : 2 * c] / packed[-1]
        scale = invstd if weight is None else invstd * weight
        dx = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
        dweight = dbias = None
        if weight is not None:  # this rank's part; the gradient all-reduce adds the others'
            dweight, dbias = sum_dy_xhat, sum_dy
        return dx, dweight, dbias, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch normalisation with statistics over the global batch of all ranks, from scratch.

    A drop-in for ``nn.BatchNorm1d/2d/3d`` (input ``(B, C, ...)``; same parameters, buffers and
    ``state_dict``): in training mode the mean and variance come from
    :func:`global_batch_stats` and the backward pass all-reduces the two sums it needs; in eval
    mode it is plain BatchNorm with the running statistics. Every rank must call it the same
    number of times (each call is a collective). Float32 computations. Chapter 8.
    """

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects input (B, C, ...), got shape {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got {x.shape[1]} channels (shape "
                f"{tuple(x.shape)}); the channel dimension is 1"
            )
        if not (self.training or not self.track_running_stats):
            return super().forward(x)
        mean, var, unbiased = global_batch_stats(x)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = (
                    1.0 / float(self.num_batches_tracked)
                    if self.momentum is None
                    else self.momentum
                )
                self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        return _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, mean.to(x.dtype), var.to(x.dtype), self.eps
        )


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by a :class:`SyncBatchNorm` with the same
    parameters and running statistics (like ``nn.SyncBatchNorm.convert_sync_batchnorm``).
    Returns the converted module (the same object unless ``module`` itself is a BatchNorm)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, SyncBatchNorm
    ):
        new = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine,
            module.track_running_stats, device=module.weight.device if module.affine else None,
        )  # fmt: skip
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module
