"""Manual data parallelism on a list of devices: what ``nn.DataParallel`` does, written out.

``nn.DataParallel`` runs four phases at every forward pass. Chapter 3 writes each as a function,
and chapter 2 uses them to show the phases on machines that have fewer GPUs than devices wanted::

    replicas = create_replicas(model, devices)    # replicate: one copy of the model per device
    inputs = scatter(batch, devices)              # scatter: the batch split along dim 0
    outputs = parallel_apply(replicas, inputs)    # parallel_apply: one thread per replica
    out = gather(outputs, devices[0])             # gather: the outputs concatenated on device 0

:func:`data_parallel_step` puts them together into one training step that gives the same loss,
gradients and updated weights as one device on the whole batch (and as ``nn.DataParallel``).

The batch phases (``chunk_data``, ``scatter``, ``parallel_apply``, ``gather``) are in
:mod:`dpcourse.replicas.scatter_gather` and importable from here. A "device" is anything
``torch.device`` accepts. The same device may appear several times: on a CPU-only machine
``devices_for(4)`` is the
CPU four times, and every function here works on it
(the copies between devices are then copies in memory).

Chapter 2: the idea of data parallelism (chapter 3 writes each phase out).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from itertools import chain

import torch
from torch import nn

from dpcourse import runtime
from dpcourse.replicas.scatter_gather import gather, parallel_apply, scatter

__all__ = [
    "devices_for",
    "module_device",
    "replica_devices",
    "device_copy",
    "create_replicas",
    "broadcast_parameters",
    "reduce_gradients",
    "data_parallel_step",
    "train_data_parallel",
    "gradients",
    "max_difference",
]

Device = torch.device | str
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------------- devices
def devices_for(n: int) -> list[torch.device]:
    """``n`` devices for ``n`` replicas, as :mod:`dpcourse.runtime` places ranks.

    With at least ``n`` GPUs: ``cuda:0`` ... ``cuda:n-1``; with fewer, the GPUs shared round-robin;
    without a GPU, the CPU ``n`` times. Chapters 2-4 call it instead of naming devices.
    """
    if n < 1:
        raise ValueError(f"need at least one replica, got n={n}")
    backend = runtime.choose_backend(n)
    return [runtime.device_for_rank(i, n, backend) for i in range(n)]


def module_device(module: nn.Module) -> torch.device:
    """The one device that holds every parameter and buffer of ``module``.

    Raises ``ValueError`` when they are spread over several devices (a replica must live on one)
    or when the module has no tensors at all.
    """
    found = {t.device for t in chain(module.parameters(), module.buffers())}
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no parameters or buffers, so it has no device: "
            "there is nothing to replicate"
        )
    if len(found) > 1:
        names = ", ".join(sorted(str(d) for d in found))
        raise ValueError(
            f"{type(module).__name__} has parameters or buffers on several devices ({names}); "
            "a model to replicate must live on one device: call .to(device) on it first"
        )
    return found.pop()


def device_copy(module: nn.Module, device: Device) -> nn.Module:
    """An independent copy of ``module`` on ``device``, with no gradients.

    Parameters and buffers are new tensors (changing the copy never changes the original), with
    the same values, dtypes and ``requires_grad`` flags. Chapter 3.
    """
    module_device(module)  # refuse a module spread over devices, with a clear message
    replica = copy.deepcopy(module).to(device)
    for p in replica.parameters():
        # nn.Parameter's deepcopy already leaves .grad behind; this makes sure of it for any
        # parameter type, since a fresh replica must start without gradients.
        p.grad = None
    return replica


def create_replicas(model: nn.Module, devices: Sequence[Device]) -> list[nn.Module]:
    """One copy of ``model`` per entry of ``devices`` (repeats allowed), all equal bit for bit.

    Every replica is copied from one CPU master copy, never from another replica or GPU to GPU,
    so they start identical whatever the devices. ``model`` itself is not changed. Chapter 3.
    """
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise ValueError("need at least one device to replicate the model on, got none")
    master = device_copy(model, "cpu")
    return [device_copy(master, d) for d in devices]


def replica_devices(replicas: Sequence[nn.Module]) -> list[torch.device]:
    """The device of each replica, after checking that each lives on one device and that all
    have the same parameters and buffers as replica 0 (a ``ValueError`` saying what differs
    otherwise). Chapters 3 and 4."""
    if not replicas:
        raise ValueError("need at least one replica, got none")
    devices = []
    for i, r in enumerate(replicas):
        try:
            devices.append(module_device(r))
        except ValueError as exc:
            raise ValueError(f"replica {i}: {exc}") from None
        if i:
            _check_same_structure(replicas[0], r, i)
    return devices


# ---------------------------------------------------------------------- keeping copies equal
def _check_same_structure(master: nn.Module, replica: nn.Module, i: int) -> None:
    mine = [(n, p.shape, p.dtype, p.requires_grad) for n, p in master.named_parameters()]
    theirs = [(n, p.shape, p.dtype, p.requires_grad) for n, p in replica.named_parameters()]
    if mine != theirs:
        raise ValueError(
            f"replica {i} does not have the master's parameters (names, shapes, dtypes and "
            "requires_grad must all match): make the replicas with create_replicas(master, ...)"
        )
    if [n for n, _ in master.named_buffers()] != [n for n, _ in replica.named_buffers()]:
        raise ValueError(f"replica {i} does not have the master's buffers")


@torch.no_grad()
def broadcast_parameters(master: nn.Module, replicas: Sequence[nn.Module]) -> None:
    """Copy the master's parameters and buffers into every replica, in place.

    Frozen parameters are copied too (they may have been changed by hand); gradients are not
    touched. ``nn.DataParallel`` does this at every forward pass (it replicates the module each
    time), which is one of its costs (chapter 2). Chapter 3.
    """
    module_device(master)
    for i, replica in enumerate(replicas):
        module_device(replica)
        _check_same_structure(master, replica, i)
        for src, dst in zip(
            chain(master.parameters(), master.buffers()),
            chain(replica.parameters(), replica.buffers()),
            strict=True,
        ):
            dst.copy_(src)


@torch.no_grad()
def reduce_gradients(replicas: Sequence[nn.Module], master: nn.Module) -> None:
    """Set each master parameter's ``.grad`` to the sum of the replicas' gradients.

    Each replica's gradient is copied to the master's device and added there, in replica order.
    Frozen parameters (``requires_grad=False``) are skipped; a parameter that no replica has a
    gradient for keeps ``grad=None``. Sums, not averages: :func:`data_parallel_step` takes the loss
    over the whole gathered batch, so each replica's gradient is already its share. Chapter 3.
    """
    device = module_device(master)
    for i, r in enumerate(replicas):
        _check_same_structure(master, r, i)
    # The structures match, so the replicas' parameters line up with the master's, in order.
    columns = zip(master.parameters(), *(r.parameters() for r in replicas), strict=True)
    for p, *copies in columns:
        if not p.requires_grad:
            continue
        present = [c.grad for c in copies if c.grad is not None]
        if not present:
            p.grad = None
            continue
        total = torch.zeros_like(p)
        for g in present:
            total += g.to(device)
        p.grad = total


def data_parallel_step(
    master: nn.Module,
    replicas: Sequence[nn.Module],
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    output_device: Device | None = None,
    threads: bool = True,
) -> float:
    """One training step of manual data parallelism, the way ``nn.DataParallel`` takes it.

    ``batch`` is ``(inputs..., target)``; ``optimizer`` updates the ``master``'s parameters (the
    master may live anywhere: the CPU, or a GPU). The step

    1. copies the master's parameters and buffers into the replicas (:func:`broadcast_parameters`);
    2. splits the inputs between them (:func:`scatter`) and runs the forwards
       (:func:`parallel_apply`);
    3. gathers the outputs on ``output_device`` (default: the first replica's device), computes the
       loss of the whole batch there, and runs backward, which reaches every replica;
    4. sums the replicas' gradients into the master (:func:`reduce_gradients`) and steps the
       optimizer.

    Because the loss is that of the whole batch, the result equals one device's step on the
    whole batch, up to rounding, whatever the split. Buffers (BatchNorm's running statistics) come
    back from replica 0 alone, as in ``nn.DataParallel``, whose replica 0 shares the module's
    buffers. Returns the loss (before the update). Chapters 2 and 3 (chapter 2 times each phase
    with :func:`dpcourse.replicas.dataparallel.time_phases`).
    """
    devices = replica_devices(replicas)
    module_device(master)  # the master lives on one device (any one)
    output_device = devices[0] if output_device is None else torch.device(output_device)
    *inputs, target = batch
    if not inputs:
        raise ValueError("a training batch is (inputs..., target): got the target only")
    broadcast_parameters(master, replicas)  # replicate
    for r in replicas:
        r.zero_grad(set_to_none=True)
    chunks = scatter(inputs, devices)  # scatter
    outputs = parallel_apply(replicas, chunks, threads=threads)  # forward
    output = gather(outputs, output_device)  # gather
    loss = loss_fn(output, target.to(output_device))
    loss.backward()  # loss+backward: reaches every replica
    with torch.no_grad():
        for src, dst in zip(replicas[0].buffers(), master.buffers(), strict=True):
            dst.copy_(src)
    optimizer.zero_grad(set_to_none=True)
    reduce_gradients(replicas[: len(chunks)], master)  # reduce
    optimizer.step()  # update
    return loss.item()


def train_data_parallel(
    model: nn.Module,
    batches: Iterable[Sequence[torch.Tensor]],
    devices: Sequence[Device],
    loss_fn: LossFn,
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
) -> tuple[nn.Module, list[float]]:
    """Train a CPU master copy of ``model`` with :func:`data_parallel_step` on replicas on
    ``devices``, one step per batch ``(inputs..., target)``; returns the master and the loss of
    every step. ``model`` itself is not changed. Chapter 3 compares it with one device."""
    master = device_copy(model, "cpu")
    replicas = create_replicas(master, devices)
    optimizer = make_optimizer(master.parameters())
    losses = [data_parallel_step(master, replicas, b, loss_fn, optimizer) for b in batches]
    return master, losses


# --------------------------------------------------------------------------- inspection
def gradients(
    model: nn.Module, batch: Sequence[torch.Tensor], loss_fn: LossFn
) -> dict[str, torch.Tensor]:
    """The gradient of ``loss_fn(model(*inputs), target)`` for every trainable parameter, by name.

    Computed with ``torch.autograd.grad``, so the model's ``.grad`` fields are left alone.
    Chapter 2 compares the gradient of a whole batch with those of its shards.
    """
    *inputs, target = batch
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters, so there is no gradient")
    loss = loss_fn(model(*inputs), target)
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {
        n: torch.zeros_like(p) if g is None else g
        for (n, p), g in zip(named, grads, strict=True)
    }


def max_difference(a: nn.Module | dict, b: nn.Module | dict) -> float:
    """The largest absolute difference between two models' parameters (or two dicts of tensors
    with the same keys), compared on the CPU. 0.0 means equal bit for bit. Chapters 2-4."""
    ta = dict(a.named_parameters()) if isinstance(a, nn.Module) else dict(a)
    tb = dict(b.named_parameters()) if isinstance(b, nn.Module) else dict(b)
    if ta.keys() != tb.keys():
        raise ValueError(f"different names: {sorted(ta.keys() ^ tb.keys())}")
    worst = 0.0
    for k in ta:
        x, y = ta[k].detach().cpu(), tb[k].detach().cpu()
        if x.shape != y.shape:
            raise ValueError(f"{k}: shapes {tuple(x.shape)} and {tuple(y.shape)} differ")
        if x.numel():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst
