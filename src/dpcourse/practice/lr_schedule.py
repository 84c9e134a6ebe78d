"""Learning rates for large effective batches: the scaling rules and warm-up (chapter 8).

With N ranks of B samples each, one optimizer step averages the gradient over N·B samples: the
effective batch is N times larger, and a run makes N times fewer steps per epoch. Two rules say
how to change the learning rate to keep training on course:

* **linear** (Goyal et al., 2017): multiply it by N. For SGD, k steps of size η on batches of B
  move the weights about as far as one step of size kη on a batch of kB, as long as the gradient
  changes little over those k steps;
* **square root** (Krizhevsky, 2014): multiply it by √N, which keeps the variance of the update
  the same; gentler, and a common choice for Adam.

Early in training the gradient changes fast and the linear rule's large step can diverge, so it
comes with a **warm-up**: start from the single-rank learning rate and ramp up linearly to the
scaled one over the first steps. :func:`large_batch_run` simulates N ranks' effective batch on one
process (one batch of N·B samples is exactly what N ranks of B average over), so the chapter can
compare the rules on measured loss curves.

Chapter 8: learning-rate scaling rules and warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dpcourse.one_device.data import random_regression
from dpcourse.one_device.models import MLP
from dpcourse.one_device.training import train_step

__all__ = ["RULES", "scaled_lr", "lr_at", "noam_lr", "LargeBatchRun", "large_batch_run"]

RULES = ("none", "linear", "sqrt")


def scaled_lr(base_lr: float, world_size: int, rule: str = "linear") -> float:
    """The learning rate for ``world_size`` ranks, from the one that works on a single rank:
    ``base_lr`` times ``world_size`` (``"linear"``), ``√world_size`` (``"sqrt"``) or 1
    (``"none"``)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if rule == "linear":
        return base_lr * world_size
    if rule == "sqrt":
        return base_lr * world_size**0.5
    if rule == "none":
        return base_lr
    raise ValueError(f"rule must be one of {RULES}, got {rule!r}")


def lr_at(step: int, base_lr: float, world_size: int, warmup: int, rule: str = "linear") -> float:
    """The learning rate of step ``step`` (counted from 0): a linear ramp from ``base_lr`` at
    step 0 to ``scaled_lr(base_lr, world_size, rule)`` at step ``warmup``, constant after
    (Goyal et al.'s gradual warm-up). ``warmup=0`` means no ramp. Used by
    :mod:`dpcourse.practice.train` and chapter 8's first exercise."""
    if step < 0 or warmup < 0:
        raise ValueError(f"step and warmup must be >= 0, got step={step}, warmup={warmup}")
    target = scaled_lr(base_lr, world_size, rule)
    if step >= warmup:
        return target
    return base_lr + (target - base_lr) * step / warmup


def noam_lr(step: int, d_model: int, warmup: int, factor: float = 1.0) -> float:
    """The Transformer's learning rate ("Noam", Vaswani et al., 2017) at step ``step`` (from 0):
    factor x d_model^-1/2 x min(s^-1/2, s x warmup^-3/2) with s = step + 1. It rises linearly
    for ``warmup`` steps, peaks at step ``warmup - 1`` at factor x (d_model x warmup)^-1/2 and
    then decays as 1/sqrt(s). Counting s from 1 gives the first step a rate above 0 (with s =
    step the first step would not move the weights). As a multiplier of a base rate of 1:
    ``LambdaLR(opt, lambda s: noam_lr(s, d_model, warmup))``. Chapter 8."""
    if step < 0 or d_model < 1 or warmup < 1:
        raise ValueError(f"need step >= 0, d_model >= 1 and warmup >= 1, got step={step}, "
                         f"d_model={d_model}, warmup={warmup}")
    s = step + 1
    return factor * d_model**-0.5 * min(s**-0.5, s * warmup**-1.5)


@dataclass
class LargeBatchRun:
    """One simulated run: the loss of every step, and the samples seen after each step."""

    world_size: int
    rule: str
    warmup: int
    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    final_loss: float = float("nan")  # on the whole data set, after the last step

    @property
    def label(self) -> str:
        warm = f", warm-up {self.warmup} steps" if self.warmup else ""
        return f"N={self.world_size}, {self.rule} rule{warm}"


def large_batch_run(
    world_size: int,
    rule: str = "linear",
    warmup: int = 0,
    per_rank_batch: int = 8,
    base_lr: float = 0.02,
    num_samples: int = 6400,
    momentum: float = 0.9,
    seed: int = 0,
) -> LargeBatchRun:
    """Train chapter 1's MLP on :func:`~dpcourse.one_device.data.random_regression` (4,096 samples)
    with SGD and momentum, on batches of ``world_size * per_rank_batch`` samples drawn at random,
    for as many steps as it takes to see ``num_samples`` samples, with the learning rate of
    :func:`lr_at`. The same model initialisation for every run (``seed``). One process, CPU.

    One batch of N·B samples gives the gradient that N ranks of B samples average, so this is a
    simulation of N ranks' *effective batch* (the numbers are those of real training, the time is
    not). Chapter 8 plots the losses against samples seen for the scaling rules.
    """

    x, y = random_regression(4096, seed=1).tensors
    batch = world_size * per_rank_batch
    steps = num_samples // batch
    if steps < 1:
        raise ValueError(f"num_samples={num_samples} is less than one batch of {batch}")
    torch.manual_seed(seed)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=base_lr, momentum=momentum)
    g = torch.Generator().manual_seed(seed + 1)
    run = LargeBatchRun(world_size, rule, warmup)
    for step in range(steps):
        lr = lr_at(step, base_lr, world_size, warmup, rule)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, len(x), (batch,), generator=g)
        loss = train_step(model, (x[idx], y[idx]), optimizer, torch.nn.functional.mse_loss)
        run.lrs.append(lr)
        run.losses.append(loss)
        run.samples.append((step + 1) * batch)
    with torch.no_grad():
        run.final_loss = torch.nn.functional.mse_loss(model(x), y).item()
    return run
