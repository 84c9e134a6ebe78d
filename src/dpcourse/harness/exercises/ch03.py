"""Checks for chapter 3's exercises (manual replication).

Chapter 3: manual replication.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from dpcourse.harness.exercises.core import Mismatch, NotAttempted, call_learner, exercise
from dpcourse.one_device import data, models, training
from dpcourse.replicas import replication, scatter_gather

CHUNK_CASES = [(30, 4), (7, 7), (10, 3), (9, 8), (37, 5), (1, 1), (100, 3)]


@exercise("ex-3-chunk", function="my_chunk_data", timeout=10)
def chunk_data(fn: Callable) -> str:
    """``fn(batch, n)`` against :func:`dpcourse.replicas.scatter_gather.chunk_data` on tensors, and
    the ``ValueError`` it must raise for a batch smaller than ``n``."""
    for batch_size, n in CHUNK_CASES:
        batch = torch.arange(batch_size)
        want = scatter_gather.chunk_data(batch, n)
        got = call_learner(fn, batch, n)
        if not isinstance(got, list | tuple) or not all(isinstance(c, torch.Tensor) for c in got):
            raise Mismatch(f"batch of {batch_size} into {n}: expected a list of tensors, got "
                           f"{type(got).__name__}")
        sizes, want_sizes = [len(c) for c in got], [len(c) for c in want]
        if sizes != want_sizes:
            hint = ""
            if sum(sizes) != batch_size:
                hint = f" Your chunks hold {sum(sizes)} samples in all, not {batch_size}."
            elif sorted(sizes, reverse=True) != want_sizes or len(sizes) != len(want_sizes):
                hint = (f" Like torch.chunk, every chunk but the last holds ceil({batch_size}/"
                        f"{n}) = {want_sizes[0]} samples and the last what is left.")
            raise Mismatch(f"batch of {batch_size} into {n}: expected chunks of sizes "
                           f"{want_sizes}, got {sizes}.{hint}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if not torch.equal(g, w):
                raise Mismatch(f"batch of {batch_size} into {n}: chunk {i} should hold samples "
                               f"{w.tolist()}, got {g.tolist()} (keep the samples in order)")
    for batch_size, n in [(3, 4), (0, 2)]:
        try:
            got = fn(torch.arange(batch_size), n)
        except ValueError:
            continue
        except NotImplementedError as exc:
            raise NotAttempted(str(exc)) from exc
        except Exception as exc:
            raise Mismatch(f"a batch of {batch_size} into {n} chunks should raise ValueError, "
                           f"yours raised {type(exc).__name__}: {exc}") from None
        raise Mismatch(f"a batch of {batch_size} into {n} chunks should raise a ValueError that "
                       f"says what to do, yours returned {got!r}")
    return (f"splits {len(CHUNK_CASES)} batches like torch.chunk and refuses batches smaller "
            "than n")


class _PartlyFrozen(nn.Module):
    """An MLP with a frozen first layer and a buffer: what a replica must copy faithfully."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = models.MLP()
        self.mlp.fc1.requires_grad_(False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x * self.scale)


@exercise("ex-3-replicas", function="my_create_replicas", timeout=20)
def create_replicas(fn: Callable) -> str:
    """``fn(model, devices)`` must return one independent, identical copy per device."""
    for n in (1, 3):
        torch.manual_seed(0)
        model = _PartlyFrozen()
        model(torch.randn(2, 5)).sum().backward()  # the original carries gradients
        reference = copy.deepcopy(model)
        devices = replication.devices_for(n)
        got = call_learner(fn, model, devices)
        if not isinstance(got, list | tuple) or len(got) != n:
            raise Mismatch(f"{n} device(s): expected a list of {n} replicas, got {got!r}")
        owners = {p.data_ptr(): "the model" for p in model.parameters()}
        for i, replica in enumerate(got):
            if replica is model:
                raise Mismatch(f"replica {i} is the model itself: copy it (copy.deepcopy), do not "
                               "reuse it (and note that .to() on a model returns the model)")
            for j in range(i):
                if replica is got[j]:
                    raise Mismatch(f"replicas {j} and {i} are the same object: each device needs "
                                   "its own copy")
            for p in replica.parameters():
                owner = owners.get(p.data_ptr())
                if owner is not None:
                    raise Mismatch(f"replica {i} shares parameter memory with {owner}: a change "
                                   "to one would change the other (a shallow copy?)")
            owners.update({p.data_ptr(): f"replica {i}" for p in replica.parameters()})
            if replication.max_difference(replica, reference) != 0.0:
                raise Mismatch(f"replica {i}'s parameters differ from the model's: a replica is a "
                               "copy of the model, not a newly built one")
            if not torch.equal(replica.scale.cpu(), reference.scale):
                raise Mismatch(f"replica {i}'s buffer 'scale' differs from the model's")
            if replication.module_device(replica) != devices[i]:
                raise Mismatch(f"replica {i} is on {replication.module_device(replica)}, "
                               f"expected {devices[i]}")
            flags = [p.requires_grad for p in replica.parameters()]
            if flags != [p.requires_grad for p in reference.parameters()]:
                raise Mismatch(f"replica {i}: the frozen layer is trainable again (or the other "
                               "way round); keep each parameter's requires_grad")
            if any(p.grad is not None for p in replica.parameters()):
                raise Mismatch(f"replica {i} carries gradients: a fresh replica starts with "
                               "grad=None")
        if replication.max_difference(model, reference) != 0.0:
            raise Mismatch("making the replicas changed the model itself")
    return "identical, independent replicas, frozen layer and buffer included"


def _reference_run(model, batches, n, loss_fn, make_opt):
    ref = copy.deepcopy(model)
    opt = make_opt(ref.parameters())
    losses = [training.train_step(ref, batch, opt, loss_fn) for batch in batches]
    return ref, losses


@exercise("ex-3-step", function="my_data_parallel_step", timeout=30)
def data_parallel_step(fn: Callable) -> str:
    """``fn(master, replicas, batch, loss_fn, optimizer)`` over three steps, against one device
    on the whole batch (float64, SGD), for 1 to 4 replicas and batches that do not divide."""
    x, y = data.random_regression().tensors
    x, y = x.double(), y.double()
    loss_fn = nn.MSELoss()
    batches = [(x[:37], y[:37]), (x[37:67], y[37:67]), (x[67:], y[67:])]
    make_opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    for n in (1, 2, 3, 4):
        torch.manual_seed(0)
        model = models.MLP().double()
        ref_model, ref_losses = _reference_run(model, batches, n, loss_fn, make_opt)
        master = copy.deepcopy(model)
        replicas = replication.create_replicas(master, replication.devices_for(n))
        opt = make_opt(master.parameters())
        before = {k: v.detach().clone() for k, v in master.named_parameters()}
        one_ref, _ = _reference_run(model, batches[:1], n, loss_fn, make_opt)
        for step, batch in enumerate(batches):
            got = call_learner(fn, master, replicas, batch, loss_fn, opt)
            if isinstance(got, torch.Tensor) and got.numel() == 1:
                got = got.item()
            if not isinstance(got, int | float) or abs(got - ref_losses[step]) > 1e-9:
                hint = ""
                if step > 0:
                    hint = (f" Step 0 was right but step {step} is not: did you copy the master's"
                            " new weights into the replicas before this forward?")
                raise Mismatch(f"{n} replica(s), step {step}: expected the loss of the whole batch"
                               f", {ref_losses[step]:.6f}, got {got!r}.{hint}")
            if step == 0:
                want = {k: v - before[k] for k, v in one_ref.named_parameters()}
                have = {k: v.detach() - before[k] for k, v in master.named_parameters()}
                ratio = sum((have[k] * want[k]).sum() for k in want) / sum(
                    (want[k] ** 2).sum() for k in want)
                if n > 1 and abs(ratio - 1 / n) < 0.01:
                    raise Mismatch(f"{n} replicas: your update is 1/{n} of one device's. The loss "
                                   "of the gathered batch already gives each replica its share "
                                   "of the gradient: sum the replicas' gradients, do not average")
                if replication.max_difference(master, one_ref) > 1e-10:
                    raise Mismatch(f"{n} replica(s), step 0: the master's weights after the "
                                   "update differ from one device's by "
                                   f"{replication.max_difference(master, one_ref):.3g}; did "
                                   "every replica's gradient reach the master?")
            elif replication.max_difference(master, _reference_run(
                    model, batches[: step + 1], n, loss_fn, make_opt)[0]) > 1e-10:
                raise Mismatch(f"{n} replica(s): step 0 is right but step {step} is not. Did you "
                               "copy the master's new weights into the replicas (and zero their "
                               "gradients) before the next forward?")
        if replication.max_difference(master, ref_model) > 1e-10:
            raise Mismatch(f"{n} replica(s): after 3 steps the master differs from one device")
    return "the same losses and weights as one device for 1 to 4 replicas, over 3 steps"
