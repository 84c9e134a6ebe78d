"""Checks for chapter 4's exercises (naive gradient averaging, parameter averaging).

Chapter 4: naive gradient averaging.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch import nn

from dpcourse.harness.exercises.core import (
    Mismatch,
    about,
    call_learner,
    exercise,
    expect_close,
    shares_memory,
)
from dpcourse.harness.exercises.devices import as_on_gpus
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
    mean of the replicas' gradients: the gradient of the whole batch, in a tensor of the
    replica's own (no two replicas sharing one). The last case is run again with replica 0 on
    the CPU and the others modelled on a GPU (:func:`as_on_gpus`): arithmetic across devices,
    or a CPU tensor handed to a GPU replica as its ``.grad``, fails there as on GPUs."""
    cases = [([0.5, 0.5], False), ([0.25, 0.25, 0.1, 0.4], False), ([0.25, 0.25, 0.1, 0.4], True),
             ([0.1, 0.2, 0.7], False), ([0.1, 0.2, 0.7], "on GPUs")]
    for fractions, frozen in cases:
        on_gpus = frozen == "on GPUs"
        frozen = frozen is True
        replicas, sizes, whole = _replicas_after_backward(fractions, frozen)
        before = [{n: p.grad.clone() for n, p in r.named_parameters() if p.grad is not None}
                  for r in replicas]
        where = (f"shards of sizes {sizes}" + (" with fc1 frozen" if frozen else "")
                 + (", replica 0 on the CPU and the others on a GPU" if on_gpus else ""))
        with about(where), as_on_gpus(host=replicas[:1], device=replicas[1:]) if on_gpus \
                else contextlib.nullcontext():
            call_learner(fn, replicas, list(sizes))
        _expect_own_tensors(replicas, "gradient", where)
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


def _expect_own_tensors(replicas: list[nn.Module], what: str, where: str) -> None:
    """Raise unless every replica's parameters (``what="parameter"``) or gradients are tensors
    of its own, sharing memory with no other replica's."""
    for name, _ in replicas[0].named_parameters():
        tensors = []
        for r in replicas:
            p = r.get_parameter(name)
            tensors.append(p if what == "parameter" else p.grad)
        for i, a in enumerate(tensors):
            for j in range(i):
                b = tensors[j]
                if a is not None and b is not None and shares_memory(a, b):
                    fix = "p.grad.copy_(mean)" if what == "gradient" else "p.copy_(mean)"
                    attribute = "grad" if what == "gradient" else "data"
                    harm = ("the next backward would add every replica's gradient into it"
                            if what == "gradient" else "one replica's step would move the others")
                    raise Mismatch(
                        f"{where}: replicas {j} and {i} share one tensor as the {what} of "
                        f"{name} (p.{attribute} = mean on every replica?), so {harm}. Each "
                        f"replica keeps its own, on its own device: copy the mean into it ({fix})"
                    )


@exercise("ex-4-params", function="my_average_parameters", timeout=20)
def average_parameters(fn: Callable) -> str:
    """``fn(replicas)`` must set every replica's parameters to their mean over the replicas, in
    place: the same tensors, their dtype kept (float32 and float64 MLPs), none shared between
    replicas. The last case is run with replica 0 on the CPU and the others modelled on a GPU
    (:func:`as_on_gpus`), where arithmetic across devices fails as on GPUs."""
    for n, dtype, on_gpus in ((1, torch.float32, False), (2, torch.float32, False),
                              (3, torch.float64, False), (5, torch.float32, False),
                              (3, torch.float32, True)):
        torch.manual_seed(n)
        replicas = replication.create_replicas(models.MLP().to(dtype),
                                               replication.devices_for(n))
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
        tensors = [list(r.parameters()) for r in replicas]
        where = (f"{n} replicas in {str(dtype).removeprefix('torch.')}"
                 + (", replica 0 on the CPU and the others on a GPU" if on_gpus else ""))
        with about(where), as_on_gpus(host=replicas[:1], device=replicas[1:]) if on_gpus \
                else contextlib.nullcontext():
            call_learner(fn, replicas)
        _expect_own_tensors(replicas, "parameter", where)
        for i, r in enumerate(replicas):
            now = list(r.parameters())
            if len(now) != len(tensors[i]) or any(
                    a is not b for a, b in zip(now, tensors[i], strict=True)):
                raise Mismatch(f"{where}: replica {i}'s parameters are new objects: set them in "
                               "place (p.copy_(mean) under torch.no_grad()), so that an "
                               "optimizer holding them sees the new values")
            for name, p in r.named_parameters():
                if p.dtype != dtype:
                    raise Mismatch(f"{where}: replica {i}'s {name} is now {p.dtype}, it was "
                                   f"{dtype}: averaging must keep the parameters' dtype")
        for i, r in enumerate(replicas):
            for name, p in r.named_parameters():
                if n > 1 and torch.allclose(p, total[name]):
                    raise Mismatch(f"{where}: replica {i}'s {name} is the sum of the "
                                   f"replicas' values; divide by {n}")
                if n > 1 and torch.equal(p, want[i][name]):
                    raise Mismatch(f"{where}: replica {i}'s {name} did not change: set every "
                                   "replica to the mean, not only the first")
                tight = dtype == torch.float64
                expect_close(p.detach(), mean[name], f"{where}: replica {i}'s {name}",
                             rtol=1e-12 if tight else 1e-5, atol=1e-12 if tight else 1e-6)
    return ("every replica holds the mean of the parameters, in place and in its own tensors, "
            "for 1 to 5 replicas in float32 and float64")
