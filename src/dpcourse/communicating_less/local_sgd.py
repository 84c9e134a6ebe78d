"""Local SGD across ranks: every rank steps alone, and every ``period`` steps the ranks
average their parameters.

Chapter 4 ran the idea on one process (:mod:`dpcourse.replicas.parameter_averaging`: replicas
averaged through the CPU every ``k`` steps). Across ranks the average is one all-reduce of the
parameters, flattened into one tensor: the model's bytes once per ``period`` steps, where DDP
sends the gradients' bytes every step, so ``period`` times fewer bytes. With plain SGD and
``period = 1`` it is DDP exactly; as ``period`` grows the replicas drift apart between
averages, which costs steps to reach a loss (the chapter measures how many).

:class:`LocalSGD` wraps an optimizer as torch's ``PostLocalSGDOptimizer`` with a
``PeriodicModelAverager`` does, on the same schedule: the averager counts its calls from 0 and
averages at call ``warmup_steps`` and every ``period`` calls after (so ``warmup_steps =
period - 1`` averages after steps ``period``, ``2 period``, ..., chapter 4's schedule). Only the
parameters that have a gradient are averaged, as torch's; the optimizer's state (momentum, Adam's
moments) stays each rank's own. ``tests/test_communicating_less.py`` checks it against torch's on
2 to 4 ranks, and against chapter 4's one-process version.

Chapter 12: local SGD, model averaging every few steps.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["average_parameters", "LocalSGD"]


@torch.no_grad()
def average_parameters(params: Iterable[nn.Parameter],
                       group: dist.ProcessGroup | None = None) -> None:
    """Replace every parameter of ``params`` by its mean over the ranks of
    ``group``: one all-reduce of them all, flattened (divided by N first, as
    torch's averager does)."""
    params = list(params)
    flat = torch.cat([p.reshape(-1) for p in params])
    flat /= dist.get_world_size(group)
    dist.all_reduce(flat, group=group)
    at = 0
    for p in params:
        p.copy_(flat[at : at + p.numel()].view_as(p))
        at += p.numel()


class LocalSGD:
    """``optimizer`` stepping alone on each rank, the parameters averaged over ``group`` every
    ``period`` steps after ``warmup_steps`` (torch's ``PeriodicModelAverager`` schedule). Use it
    as the optimizer: ``zero_grad()``, ``backward()``, ``step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, period: int, warmup_steps: int = 0,
                 group: dist.ProcessGroup | None = None) -> None:
        if period < 1 or warmup_steps < 0:
            raise ValueError(f"period must be 1 or more and warmup_steps 0 or more, got "
                             f"{period} and {warmup_steps}")
        self.optimizer, self.period, self.warmup_steps = optimizer, period, warmup_steps
        self.group = group
        self.step_count = 0  # calls of step(), as the averager counts them

    def step(self) -> None:
        self.optimizer.step()
        due = (self.step_count >= self.warmup_steps
               and (self.step_count - self.warmup_steps) % self.period == 0)
        if due:
            params = [p for g in self.optimizer.param_groups
                      for p in g["params"] if p.grad is not None]
            average_parameters(params, self.group)
        self.step_count += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
