"""DiLoCo from scratch: an inner optimizer for H steps alone, then an outer step on the average
of how far the replicas moved.

Local SGD averages the weights. DiLoCo (Douillard et al., 2023) treats the round as one step of
a slower optimizer instead. Every replica starts the round from the same global weights
``theta``; it takes ``H`` steps of its **inner optimizer** (AdamW) on its own data; then the
replicas all-reduce their **pseudo-gradient**, ``theta - theta_local`` (how far the round moved
each of them, pointing back, as a gradient does), and every replica steps the **outer
optimizer** (SGD with Nesterov momentum, learning rate 0.7 in the paper) on the average, from
``theta``. With an outer SGD of learning rate 1 and no momentum, that is local SGD's average;
the momentum carries the direction of the last rounds into the next, which is what lets DiLoCo
synchronise every 500 steps of a language model at the loss of synchronising every step. The
bytes: the model once per H steps.

:class:`DiLoCo` is that, for a model on each rank (``step()`` after each backward, in place of
the inner optimizer's); ``sync(participating=False)`` lets a rank drop out of a round (its data
lost, chapter 8's failed replica): it sends zeros, and the others average over those that took
part, as torchft's ``Manager`` does. :func:`diloco_reference` is the algorithm in one process, N
replicas in a list: ``tests/test_communicating_less.py`` checks :class:`DiLoCo` on 2 to 4 ranks
against it and against torchft's ``DiLoCo`` on the same inputs.

Chapter 12: DiLoCo, inner and outer optimizers.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["pseudo_gradients", "DiLoCo", "diloco_reference"]

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@torch.no_grad()
def pseudo_gradients(
    start: Sequence[torch.Tensor], params: Sequence[nn.Parameter],
    participating: bool = True, group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """The round's pseudo-gradients ``start - params``, averaged over the
    ranks of ``group`` that take part (one all-reduce per tensor, and one of
    the count of ranks that took part)."""
    deltas = [s - p if participating else torch.zeros_like(p) for s, p in zip(
        start, params, strict=True)]
    taking_part = torch.tensor([float(participating)],
                               device=deltas[0].device)
    dist.all_reduce(taking_part, group=group)  # how many ranks took part
    if taking_part.item() == 0:  # alike on every rank: all of them raise
        raise RuntimeError("no rank took part in this round (participating="
                           "False everywhere): nothing to average; let one "
                           "replica finish its round")
    for d in deltas:
        dist.all_reduce(d, group=group)
        d /= taking_part
    return deltas


class DiLoCo:
    """DiLoCo on this rank: ``inner`` steps ``model`` every step, and every ``sync_every`` steps
    ``outer`` steps it on the averaged pseudo-gradient, from the weights the round started with.

    ``outer`` must be built on ``model.parameters()`` (SGD with ``momentum=0.9,
    nesterov=True`` in the paper). Every rank must start from the same weights (broadcast them,
    or seed the model alike). ``start`` holds the round's starting weights: a second copy of the
    model, which the paper keeps on the CPU of a GPU machine."""

    def __init__(self, model: nn.Module, inner: torch.optim.Optimizer,
                 outer: torch.optim.Optimizer, sync_every: int,
                 group: dist.ProcessGroup | None = None) -> None:
        if sync_every < 1:
            raise ValueError(f"sync_every (H, inner steps per round) must be 1 or more, got "
                             f"{sync_every}")
        self.params = list(model.parameters())
        self.inner, self.outer, self.sync_every, self.group = inner, outer, sync_every, group
        self.start = [p.detach().clone() for p in self.params]
        self.local_step = 0

    def step(self) -> None:
        """One inner step; the ``sync_every``-th of a round ends it with :meth:`sync`."""
        self.inner.step()
        self.local_step += 1
        if self.local_step == self.sync_every:
            self.sync()

    @torch.no_grad()
    def sync(self, participating: bool = True) -> None:
        """End the round: average the pseudo-gradients, go back to the round's
        start and take one outer step from there; the result starts the next
        round on every rank."""
        deltas = pseudo_gradients(self.start, self.params, participating,
                                  self.group)
        for p, s, d in zip(self.params, self.start, deltas, strict=True):
            p.copy_(s)
            p.grad = d
        self.outer.step()
        self.outer.zero_grad()
        for s, p in zip(self.start, self.params, strict=True):
            s.copy_(p)
        self.local_step = 0


def diloco_reference(model: nn.Module, batches: Sequence[Sequence[Sequence[torch.Tensor]]],
                     loss_fn: Callable, make_inner: MakeOptimizer, make_outer: MakeOptimizer,
                     sync_every: int, reset_inner: bool = False) -> nn.Module:
    """DiLoCo in one process: ``len(batches[0])`` replicas of ``model`` in a list,
    ``batches[t][w]`` the ``(inputs, targets)`` replica ``w`` trains on at step ``t``. Returns
    the global model after the last round (call it with a number of steps divisible by
    ``sync_every``); its buffers (batch norm's statistics) are ``model``'s, untouched, since no
    pseudo-gradient carries them. The reference :class:`DiLoCo` is tested against;
    ``reset_inner=True`` starts every round with fresh inner optimizers (chapter 12 shows what
    forgetting AdamW's moments costs)."""
    theta = copy.deepcopy(model)  # the global weights
    outer = make_outer(theta.parameters())
    workers = [copy.deepcopy(model) for _ in batches[0]]
    inners = [make_inner(w.parameters()) for w in workers]
    for t, step_batches in enumerate(batches, start=1):
        for w, opt, (x, y) in zip(workers, inners, step_batches, strict=True):
            opt.zero_grad()
            loss_fn(w(x), y).backward()
            opt.step()
        if t % sync_every == 0:
            with torch.no_grad():
                replicas = zip(*(w.parameters() for w in workers), strict=True)
                for g, locals_ in zip(theta.parameters(), replicas, strict=True):
                    g.grad = torch.stack([g - p for p in locals_]).mean(0)
                outer.step()
                outer.zero_grad()
                for w in workers:
                    for p, g in zip(w.parameters(), theta.parameters(), strict=True):
                        p.copy_(g)
            if reset_inner:
                inners = [make_inner(w.parameters()) for w in workers]
    return theta
