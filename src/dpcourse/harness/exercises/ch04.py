"""Checks for chapter 4's exercises (naive gradient averaging, parameter averaging).

Chapter 4: naive gradient averaging.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from dpcourse.harness.exercises.core import Mismatch, call_learner, exercise, expect_close
from dpcourse.one_device import data, models
from dpcourse.replicas import averaging, parameter_averaging, replication


def _replicas_after_backward(fractions, frozen: bool):
    """Float64 MLP replicas holding the gradients of uneven shards of 40 samples, and the whole
    batch's gradient by name."""
    x, y = data.random_regression().tensors
    batch = (x[:40].double(), y[:40].double())
    torch.manual_seed(0)
    model = models.MLP().double()
    if frozen:
        model.fc1.requires_grad_(False)
    shards = averaging.split_by_fractions(batch, fractions)
    replicas = replication.create_replicas(model, replication.devices_for(len(fractions)))
    averaging.local_backward(replicas, shards, nn.MSELoss())
    whole = replication.gradients(model, batch, nn.MSELoss())
    return replicas, [len(s[-1]) for s in shards], whole


@exercise("ex-4-weighted", function="my_average_gradients", timeout=20)
def average_gradients(fn: Callable) -> str:
    """``fn(replicas, shard_sizes)`` must leave in every replica's ``.grad`` the size-weighted
    mean of the replicas' gradients: the gradient of the whole batch."""
    cases = [([0.5, 0.5], False), ([0.25, 0.25, 0.1, 0.4], False), ([0.25, 0.25, 0.1, 0.4], True),
             ([0.1, 0.2, 0.7], False)]
    for fractions, frozen in cases:
        replicas, sizes, whole = _replicas_after_backward(fractions, frozen)
        before = [{n: p.grad.clone() for n, p in r.named_parameters() if p.grad is not None}
                  for r in replicas]
        where = f"shards of sizes {sizes}" + (" with fc1 frozen" if frozen else "")
        try:
            call_learner(fn, replicas, list(sizes))
        except Mismatch as exc:
            raise Mismatch(f"{where}: {exc}") from None
        if frozen and any(r.fc1.weight.grad is not None for r in replicas):
            raise Mismatch(f"{where}: the frozen fc1.weight now has a gradient; skip parameters "
                           "that do not require one")
        plain = {n: sum(b[n] for b in before) / len(before) for n in before[0]}
        for i, replica in enumerate(replicas):
            for name, p in replica.named_parameters():
                if not p.requires_grad:
                    continue
                if p.grad is None:
                    raise Mismatch(f"{where}: replica {i} has no gradient for {name} any more")
                if len(replicas) > 1 and torch.equal(p.grad, before[i][name]):
                    raise Mismatch(f"{where}: replica {i}'s gradient of {name} is unchanged: write "
                                   "the average back into every replica")
                if len(set(sizes)) > 1 and torch.allclose(p.grad, plain[name]):
                    raise Mismatch(f"{where}: replica {i} holds the plain mean of the gradients, "
                                   f"which weighs the shard of {min(sizes)} like the shard of "
                                   f"{max(sizes)}. Weigh each by its share of the batch.")
                expect_close(p.grad, whole[name], f"{where}: replica {i}'s gradient of {name}",
                             rtol=1e-9, atol=1e-12)
    return "every replica holds the whole batch's gradient, for even and uneven shards"


@exercise("ex-4-params", function="my_average_parameters", timeout=20)
def average_parameters(fn: Callable) -> str:
    """``fn(replicas)`` must set every replica's parameters to their mean over the replicas."""
    for n in (1, 2, 3, 5):
        torch.manual_seed(n)
        replicas = replication.create_replicas(models.MLP(), replication.devices_for(n))
        with torch.no_grad():
            for r in replicas:  # replicas that have trained apart
                for p in r.parameters():
                    p.add_(torch.randn_like(p))
                    p.grad = torch.randn_like(p)
        want = [{k: v.detach().clone() for k, v in r.named_parameters()} for r in replicas]
        reference = [copy.deepcopy(r) for r in replicas]
        parameter_averaging.average_parameters(reference)  # the package's version
        mean = {k: v.detach() for k, v in reference[0].named_parameters()}
        total = {k: sum(w[k] for w in want) for k in want[0]}
        call_learner(fn, replicas)
        for i, r in enumerate(replicas):
            for name, p in r.named_parameters():
                if n > 1 and torch.allclose(p, total[name]):
                    raise Mismatch(f"{n} replicas: replica {i}'s {name} is the sum of the "
                                   f"replicas' values; divide by {n}")
                if n > 1 and torch.equal(p, want[i][name]):
                    raise Mismatch(f"{n} replicas: replica {i}'s {name} did not change: set every "
                                   "replica to the mean, not only the first")
                expect_close(p.detach(), mean[name], f"{n} replicas: replica {i}'s {name}",
                             rtol=1e-5, atol=1e-6)
    return "every replica holds the mean of the parameters, for 1 to 5 replicas"
