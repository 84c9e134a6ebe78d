"""Manual data parallelism on a list of devices: what ``nn.DataParallel`` does, written out.

``nn.DataParallel`` runs four phases at every forward pass. Chapter 3 writes each as a function,
and chapter 2 uses them to show the phases on machines that have fewer GPUs than devices wanted::

    replicas = create_replicas(model, devices)    # replicate: one copy of the model per device
    inputs = scatter(batch, devices)              # scatter: the batch split along dim 0
    outputs = parallel_apply(replicas, inputs)    # parallel_apply: one thread per replica
    out = gather(outputs, devices[0])             # gather: the outputs concatenated on device 0

:func:`data_parallel_step` puts them together into one training step that gives the same loss,
gradients and updated weights as one device on the whole batch (and as ``nn.DataParallel``).

A "device" is anything ``torch.device`` accepts. The same device may appear several times: on a
CPU-only machine ``devices_for(4)`` is the CPU four times, and every function here works on it
(the copies between devices are then copies in memory).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import chain

import torch
from torch import nn

from dpcourse import runtime

__all__ = [
    "PHASES",
    "devices_for",
    "module_device",
    "replica_devices",
    "device_copy",
    "create_replicas",
    "chunk_data",
    "scatter",
    "parallel_apply",
    "gather",
    "broadcast_parameters",
    "reduce_gradients",
    "data_parallel_step",
    "train_data_parallel",
    "gradients",
    "max_difference",
]

Device = torch.device | str
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The phases that data_parallel_step times, in the order it runs them.
PHASES = ("replicate", "scatter", "forward", "gather", "loss+backward", "reduce", "update")


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


# ------------------------------------------------------------------------------ the batch
def _batch_tensors(batch: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    tensors = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("a batch is a tensor or a tuple of tensors (inputs..., target)")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("a batch needs a first (batch) dimension; got a 0-dimensional tensor")
    sizes = {len(t) for t in tensors}
    if len(sizes) > 1:
        raise ValueError(f"the tensors of a batch must have the same first dimension, got {sizes}")
    return tensors


def chunk_data(batch: torch.Tensor | Sequence[torch.Tensor], n: int) -> list:
    """Split a batch along its first dimension into ``n`` nearly equal chunks, like
    ``torch.chunk`` (and so like ``nn.DataParallel``'s scatter).

    ``batch`` is a tensor ``(B, ...)`` or a tuple of them with the same ``B``; the chunks are
    views of the same type. Chunks hold ``ceil(B / n)`` samples, the last one what is left, so
    30 into 8 gives seven chunks of 4 and one of 2. As with ``torch.chunk``, that rule can make
    fewer than ``n`` chunks (9 into 8 gives 2, 2, 2, 2, 1): ``nn.DataParallel`` then uses only
    as many devices as there are chunks, and so does :func:`data_parallel_step`. Raises
    ``ValueError`` for an empty batch or one smaller than ``n``. Chapters 2 and 3.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n (the number of replicas) must be a positive integer, got {n!r}")
    tensors = _batch_tensors(batch)
    size = len(tensors[0])
    if size == 0:
        raise ValueError("the batch is empty: there is nothing to split between the replicas")
    if size < n:
        raise ValueError(
            f"a batch of {size} sample(s) cannot be split between {n} replicas (each needs at "
            f"least one): use a batch of at least {n} samples, or at most {size} replicas"
        )
    pieces = [t.chunk(n) for t in tensors]
    if isinstance(batch, torch.Tensor):
        return list(pieces[0])
    return [tuple(p) for p in zip(*pieces, strict=True)]


def scatter(
    batch: torch.Tensor | Sequence[torch.Tensor], devices: Sequence[Device]
) -> list[tuple[torch.Tensor, ...]]:
    """:func:`chunk_data` into ``len(devices)`` chunks, chunk ``i`` moved to ``devices[i]``.

    Always returns tuples (a tensor batch gives 1-tuples), ready for ``replica(*chunk)``.
    May return fewer chunks than devices (see :func:`chunk_data`). Chapters 2 and 3.
    """
    devices = [torch.device(d) for d in devices]
    chunks = chunk_data(_batch_tensors(batch), len(devices))
    return [tuple(t.to(d) for t in chunk) for chunk, d in zip(chunks, devices, strict=False)]


def parallel_apply(
    replicas: Sequence[nn.Module],
    inputs: Sequence[tuple[torch.Tensor, ...]],
    threads: bool = True,
) -> list[torch.Tensor]:
    """``[replicas[i](*inputs[i]) for i ...]``, each forward in a thread of its own.

    Like ``nn.DataParallel``, one Python process drives every replica: with ``threads=True`` the
    forwards overlap as far as the GIL allows (on GPUs, while one thread waits for its kernels,
    another launches its own); ``threads=False`` runs them one after another, in order. Uses the
    first ``len(inputs)`` replicas. An exception in a replica is raised here, naming it.
    Chapters 2 and 3.
    """
    if len(inputs) > len(replicas):
        raise ValueError(f"{len(inputs)} inputs but only {len(replicas)} replicas")
    jobs = list(zip(replicas, inputs, strict=False))
    results: list = [None] * len(jobs)
    # Grad mode is a thread-local setting: the worker threads must inherit the caller's.
    grad_enabled = torch.is_grad_enabled()

    def work(i: int) -> None:
        replica, args = jobs[i]
        try:
            with torch.set_grad_enabled(grad_enabled):
                results[i] = replica(*args)
        except BaseException as exc:  # handed to the caller below
            results[i] = exc

    if threads and len(jobs) > 1:
        workers = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    else:
        for i in range(len(jobs)):
            work(i)
    for i, result in enumerate(results):
        if isinstance(result, BaseException):
            raise RuntimeError(f"replica {i} failed in its forward pass: {result!r}") from result
    return results


def gather(outputs: Sequence[torch.Tensor], device: Device) -> torch.Tensor:
    """The replicas' outputs concatenated along dim 0 on ``device`` (differentiable: the backward
    pass sends each replica the gradient of its own rows). Chapters 2 and 3."""
    if not outputs:
        raise ValueError("no outputs to gather")
    if not all(isinstance(o, torch.Tensor) for o in outputs):
        raise TypeError("gather expects one tensor per replica (a model returning one tensor)")
    return torch.cat([o.to(device) for o in outputs])


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


def _sync(devices: Sequence[torch.device]) -> None:
    # CUDA runs asynchronously: a phase has ended only when its kernels have.
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def data_parallel_step(
    master: nn.Module,
    replicas: Sequence[nn.Module],
    batch: Sequence[torch.Tensor],
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer,
    output_device: Device | None = None,
    threads: bool = True,
    timings: dict[str, float] | None = None,
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
    buffers. Returns the loss (before the update). If ``timings`` is a dict, the seconds of each
    phase (see ``PHASES``) are added to it. Chapters 2 and 3.
    """
    devices = replica_devices(replicas)
    master_device = module_device(master)
    output_device = devices[0] if output_device is None else torch.device(output_device)
    *inputs, target = batch
    if not inputs:
        raise ValueError("a training batch is (inputs..., target): got the target only")
    clock = [time.perf_counter()]

    def lap(phase: str, *where: torch.device) -> None:
        if timings is not None:
            _sync(where)
            now = time.perf_counter()
            timings[phase] = timings.get(phase, 0.0) + now - clock[0]
            clock[0] = now

    broadcast_parameters(master, replicas)
    for r in replicas:
        r.zero_grad(set_to_none=True)
    lap("replicate", *devices)
    chunks = scatter(inputs, devices)
    lap("scatter", *devices)
    outputs = parallel_apply(replicas, chunks, threads=threads)
    lap("forward", *devices)
    output = gather(outputs, output_device)
    lap("gather", output_device)
    loss = loss_fn(output, target.to(output_device))
    loss.backward()
    lap("loss+backward", *devices)
    with torch.no_grad():
        for src, dst in zip(replicas[0].buffers(), master.buffers(), strict=True):
            dst.copy_(src)
    optimizer.zero_grad(set_to_none=True)
    reduce_gradients(replicas[: len(chunks)], master)
    lap("reduce", master_device)
    optimizer.step()
    lap("update", master_device)
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
