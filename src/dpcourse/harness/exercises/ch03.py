"""Checks for chapter 3's exercises (manual replication).

Chapter 3: manual replication.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from dpcourse.harness.exercises.core import (
    Mismatch,
    NotAttempted,
    about,
    call_learner,
    call_learner_untouched,
    describe_value,
    exercise,
    shares_memory,
)
from dpcourse.harness.exercises.devices import as_on_gpus
from dpcourse.one_device import data, models, training
from dpcourse.replicas import replication, scatter_gather

# (batch size, n, the shape of one sample): 1-D batches of numbers, and batches of samples
# that are rows, images, in floats
CHUNK_CASES = [(30, 4, ()), (7, 7, ()), (10, 3, ()), (9, 8, ()), (37, 5, ()), (1, 1, ()),
               (100, 3, ()), (10, 4, (3,)), (6, 4, (2, 3, 3))]


def _batch(batch_size: int, sample: tuple[int, ...]) -> torch.Tensor:
    """A batch whose sample i holds the number i (floats for samples that are not numbers)."""
    numbers = torch.arange(batch_size)
    if not sample:
        return numbers
    return numbers.double().reshape(-1, *[1] * len(sample)).expand(-1, *sample).contiguous()


@exercise("ex-3-chunk", function="my_chunk_data", timeout=10)
def chunk_data(fn: Callable) -> str:
    """``fn(batch, n)`` against :func:`dpcourse.replicas.scatter_gather.chunk_data` on batches of
    numbers, rows and images, and the ``ValueError`` it must raise for a batch smaller than
    ``n``. Like ``torch.chunk``'s, the chunks must be views of the batch (no copy), and the
    batch must come back untouched."""
    for batch_size, n, sample in CHUNK_CASES:
        batch = _batch(batch_size, sample)
        want = scatter_gather.chunk_data(batch, n)
        if sample:
            what = f"a batch of shape {tuple(batch.shape)} into {n}"
        else:
            what = f"batch of {batch_size} into {n}"
        with about(what):
            got = call_learner_untouched(fn, ["batch"], batch, n)
        if not isinstance(got, list | tuple) or not all(isinstance(c, torch.Tensor) for c in got):
            raise Mismatch(f"{what}: expected a list of tensors, got "
                           f"{type(got).__name__}")
        sizes, want_sizes = [len(c) for c in got], [len(c) for c in want]
        if sizes != want_sizes:
            hint = ""
            if sum(sizes) != batch_size:
                hint = f" Your chunks hold {sum(sizes)} samples in all, not {batch_size}."
            elif sorted(sizes, reverse=True) != want_sizes or len(sizes) != len(want_sizes):
                hint = (f" Like torch.chunk, every chunk but the last holds ceil({batch_size}/"
                        f"{n}) = {want_sizes[0]} samples and the last what is left.")
            raise Mismatch(f"{what}: expected chunks of sizes "
                           f"{want_sizes}, got {sizes}.{hint}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g.shape != w.shape:
                raise Mismatch(f"{what}: chunk {i} has shape {tuple(g.shape)}, expected "
                               f"{tuple(w.shape)}: split along the first dimension only, and "
                               "keep the shape of each sample")
            if not torch.equal(g, w):
                samples = (w if not sample else w.reshape(len(w), -1)[:, 0].long()).tolist()
                mine = (g if not sample else g.reshape(len(g), -1)[:, 0].long()).tolist()
                raise Mismatch(f"{what}: chunk {i} should hold samples "
                               f"{samples}, got {mine} (keep the samples in order)")
            if not shares_memory(g, batch):
                raise Mismatch(f"{what}: chunk {i} is a copy. torch.chunk returns views of the "
                               "batch, which share its memory (slicing, batch[start:end], makes "
                               "one): a copy costs the batch's memory and time again")
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
    """``fn(model, devices)`` must return one independent, identical copy per device, each on
    its device: the devices this machine gives, and a list with the ``meta`` device in it, so
    that a replica left on the model's device shows on a CPU-only machine too."""
    cases = [replication.devices_for(1), replication.devices_for(3),
             # meta: a device without data (the parameters' shapes only), other than the CPU
             [replication.devices_for(1)[0], torch.device("meta")]]
    for devices in cases:
        torch.manual_seed(0)
        model = _PartlyFrozen()
        model(torch.randn(2, 5)).sum().backward()  # the original carries gradients
        reference = copy.deepcopy(model)
        names = ", ".join(map(str, devices))
        with about(f"devices [{names}]"):
            got = call_learner(fn, model, devices)
            _expect_replicas(got, model, reference, devices)
        if replication.max_difference(model, reference) != 0.0:
            raise Mismatch("making the replicas changed the model itself")
    return ("identical, independent replicas on their devices (the meta device too), frozen "
            "layer and buffer included")


def _expect_replicas(got, model: nn.Module, reference: nn.Module, devices: list) -> None:
    n = len(devices)
    if not isinstance(got, list | tuple) or len(got) != n:
        raise Mismatch(f"expected a list of {n} replicas, got {got!r}")
    owners = {p.data_ptr(): "the model" for p in model.parameters()}
    for i, replica in enumerate(got):
        if not isinstance(replica, nn.Module):
            raise Mismatch(f"replica {i} is {type(replica).__name__}, not a copy of the model")
        if replica is model:
            raise Mismatch(f"replica {i} is the model itself: copy it (copy.deepcopy), do not "
                           "reuse it (and note that .to() on a model returns the model)")
        for j in range(i):
            if replica is got[j]:
                raise Mismatch(f"replicas {j} and {i} are the same object: each device needs "
                               "its own copy")
        places = {t.device for t in [*replica.parameters(), *replica.buffers()]}
        if places != {torch.device(devices[i])}:
            where = ", ".join(sorted(map(str, places)))
            raise Mismatch(f"replica {i} is on {where}, expected {devices[i]}: move each copy "
                           "to its device (.to(device))")
        on_meta = devices[i].type == "meta"  # no data to compare there: shapes and flags only
        for p in replica.parameters():
            owner = owners.get(p.data_ptr()) if not on_meta else None
            if owner is not None:
                raise Mismatch(f"replica {i} shares parameter memory with {owner}: a change "
                               "to one would change the other (a shallow copy?)")
        if not on_meta:
            owners.update({p.data_ptr(): f"replica {i}" for p in replica.parameters()})
        shapes = [(k, v.shape, v.dtype) for k, v in replica.state_dict().items()]
        if shapes != [(k, v.shape, v.dtype) for k, v in reference.state_dict().items()]:
            raise Mismatch(f"replica {i} does not have the model's parameters and buffers (names, "
                           "shapes, dtypes)")
        if not on_meta and replication.max_difference(replica, reference) != 0.0:
            raise Mismatch(f"replica {i}'s parameters differ from the model's: a replica is a "
                           "copy of the model, not a newly built one")
        if not on_meta and not torch.equal(replica.scale.cpu(), reference.scale):
            raise Mismatch(f"replica {i}'s buffer 'scale' differs from the model's")
        flags = [p.requires_grad for p in replica.parameters()]
        if flags != [p.requires_grad for p in reference.parameters()]:
            raise Mismatch(f"replica {i}: the frozen layer is trainable again (or the other "
                           "way round); keep each parameter's requires_grad")
        if any(p.grad is not None for p in replica.parameters()):
            raise Mismatch(f"replica {i} carries gradients: a fresh replica starts with "
                           "grad=None")


def _reference_run(model, batches, n, loss_fn, make_opt):
    ref = copy.deepcopy(model)
    opt = make_opt(ref.parameters())
    losses = [training.train_step(ref, batch, opt, loss_fn) for batch in batches]
    return ref, losses


@exercise("ex-3-step", function="my_data_parallel_step", timeout=30)
def data_parallel_step(fn: Callable) -> str:
    """``fn(master, replicas, batch, loss_fn, optimizer)`` over three steps, against one device
    on the whole batch (float64, SGD), for 1 to 4 replicas and batches that do not divide, one
    of which (6 samples: 3 chunks of 2) leaves the fourth replica without a chunk. The master is
    on the CPU and the replicas are modelled on a GPU (:func:`as_on_gpus`), so that a gradient
    left on a replica's device fails here as it would there; the loss must come back as a
    float."""
    x, y = data.random_regression().tensors
    x, y = x.double(), y.double()
    loss_fn = nn.MSELoss()
    batches = [(x[:37], y[:37]), (x[37:43], y[37:43]), (x[43:], y[43:])]
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
            chunks = len(scatter_gather.chunk_data(batch[0], n))
            what = (f"{n} replica(s), step {step} (a batch of {len(batch[0])}: {chunks} "
                    f"chunk(s){', so a replica gets none' if chunks < n else ''}; the master on "
                    "the CPU, the replicas on a GPU)")
            with about(what), as_on_gpus(host=[master, *batch], device=replicas):
                got = call_learner(fn, master, replicas, batch, loss_fn, opt)
            if isinstance(got, torch.Tensor):
                raise Mismatch(f"{what}: you returned a tensor ({describe_value(got)}); return the "
                               "loss as a float, loss.item(): a tensor keeps the graph of the "
                               "whole step alive, and on a GPU reading it waits for the device")
            if not isinstance(got, int | float) or abs(got - ref_losses[step]) > 1e-9:
                hint = ""
                if step > 0:
                    hint = (f" Step 0 was right but step {step} is not: did you copy the master's"
                            " new weights into the replicas before this forward?")
                raise Mismatch(f"{what}: expected the loss of the whole batch"
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
