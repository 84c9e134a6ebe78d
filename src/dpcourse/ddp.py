"""DistributedDataParallel from scratch, in the four steps of chapter 7.

1. :func:`broadcast_parameters`: at wrap time every rank takes rank 0's parameters and buffers,
   so ranks that were seeded differently start from the same model.
2. :func:`all_reduce_gradients`: after ``backward``, one all-reduce per parameter gradient,
   divided by the world size (the mean, as torch's DDP computes it).
3. :class:`PerParameterDDP`: the same all-reduces, launched asynchronously (``async_op=True``)
   from autograd hooks (``register_post_accumulate_grad_hook``) while backward is still running,
   and waited for in :meth:`~PerParameterDDP.finish_gradient_synchronization`.
4. :class:`DDP`: gradients grouped, in reverse registration order, into :class:`Bucket` s of at
   most ``bucket_cap_mb``; each bucket is one flat tensor whose slices *are* the parameters'
   ``.grad`` (like torch's ``gradient_as_bucket_view=True``), and one asynchronous all-reduce
   per bucket starts as soon as the bucket is full. :class:`BucketManager` is the reducer.

The names follow PyTorch's DDP design note and paper (Li et al., 2020) and picotron. Every step
is tested against single-process training and torch's DDP in ``tests/test_ddp.py``; the
benchmark ``python -m dpcourse.bench ddp`` times them against torch's DDP.

What is not here: torch's smaller first bucket (1 MiB, so that communication starts early), the
bucket order rebuilt after the first step from the order gradients arrived in, communication
hooks (fp16 compression), and ``find_unused_parameters``' extra all-reduce that leaves gradients
of parameters no rank used as ``None`` (here they become zeros, which plain SGD ignores).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "broadcast_parameters",
    "broadcast_buffers",
    "all_reduce_gradients",
    "PerParameterDDP",
    "bucket_assignment",
    "Bucket",
    "BucketManager",
    "DDP",
    "BucketTiming",
    "StepTimeline",
    "timed_backward",
    "epoch_indices",
]

MB = 2**20  # bucket_cap_mb counts mebibytes, as torch's DDP does


# ------------------------------------------------------------------------------- checks
def _check_process_group(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who} needs a process group, and none is initialised in this process. Run the "
            "code on ranks with dpcourse.launch.run_ranks(fn, world_size), or under torchrun "
            "after dpcourse.runtime.init_process_group()."
        )


def _check_module(module: nn.Module, who: str) -> torch.device:
    """The one device all of ``module``'s parameters and buffers are on."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who} wraps an nn.Module, got {type(module).__name__}")
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    devices = {}
    for name, t in tensors.items():
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        where = ", ".join(f"{name} on {dev}" for dev, name in devices.items())
        raise ValueError(
            f"{who} needs every parameter and buffer of the module on one device, found {where}. "
            "Move the module with module.to(dpcourse.runtime.device()) before wrapping it."
        )
    return next(iter(devices), torch.device("cpu"))


def _check_same_model_on_every_rank(module: nn.Module, device: torch.device) -> None:
    """All ranks must hold the same parameters and buffers (shapes, and which parameters are
    trainable), or the broadcasts and all-reduces would pair up different tensors and fail or
    hang. One all-reduce of a few numbers (their maximum and minimum over the ranks) finds a
    difference."""
    params = list(module.parameters())
    trainable = [p for p in params if p.requires_grad]
    layout = tuple((tuple(p.shape), p.requires_grad) for p in params)
    layout += tuple(tuple(b.shape) for b in module.buffers())
    fingerprint = float(hash(layout) % (2**52))  # hashes of ints and tuples are not salted
    stats = torch.tensor(
        [len(trainable), sum(p.numel() for p in trainable), fingerprint], dtype=torch.float64
    )
    both = torch.cat([stats, -stats]).to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    high, low = both[:3].cpu(), -both[3:].cpu()
    if not torch.equal(high, low):
        raise RuntimeError(
            f"the ranks wrap different models: rank {dist.get_rank()} has {len(trainable)} "
            f"parameters that need gradients ({int(stats[1])} values); across the ranks the "
            f"counts range from {int(low[0])} to {int(high[0])} parameters and {int(low[1])} "
            f"to {int(high[1])} values, or the shapes of parameters or buffers differ. Build the "
            "same model, with the same frozen parameters, on every rank."
        )


# ------------------------------------------------------------------------------- step 1
def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Step 1: copy rank ``src``'s parameters and buffers to every rank, in place.

    One broadcast per tensor, in registration order (the same on every rank). Afterwards the
    ranks hold the same model, however each was initialised. Chapter 7, step 1.
    """
    _check_process_group("broadcast_parameters")
    _check_module(module, "broadcast_parameters")
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t, src=src)


def broadcast_buffers(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm's running statistics, ...) to every rank.

    What torch's DDP does before every forward with ``broadcast_buffers=True`` (the default),
    so that all ranks run the forward with rank 0's buffers. The buffers of each dtype travel
    as one flat tensor: one broadcast per dtype instead of one per buffer.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, src=src)
            for b, new in zip(buffers, flat.split([b.numel() for b in buffers]), strict=True):
                b.copy_(new.view_as(b))


# ------------------------------------------------------------------------------- step 2
def all_reduce_gradients(module: nn.Module) -> None:
    """Step 2: after ``backward``, replace every gradient by its mean over the ranks.

    One (blocking) all-reduce per parameter that requires a gradient, in registration order. A
    parameter that got no gradient on this rank takes part with zeros, so that every rank runs
    the same all-reduces and none waits forever. Chapter 7, step 2.
    """
    _check_process_group("all_reduce_gradients")
    world = dist.get_world_size()
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(world)  # dividing first, as torch's DDP does: the sum is then the mean
        dist.all_reduce(p.grad)


# ------------------------------------------------------------------------------- step 3
class PerParameterDDP(nn.Module):
    """Step 3: one asynchronous all-reduce per parameter, launched from an autograd hook.

    ``register_post_accumulate_grad_hook`` calls the hook as soon as a parameter's gradient is
    complete, while backward is still computing the gradients of earlier layers, so the
    all-reduce of the last layer's gradient overlaps the backward of the first layers. Call
    :meth:`finish_gradient_synchronization` after ``backward`` and before ``optimizer.step()``.
    Chapter 7, step 3; :class:`DDP` adds buckets.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        _check_module(module, "PerParameterDDP")
        _check_process_group("PerParameterDDP")
        self.module = module
        self.world_size = dist.get_world_size()
        broadcast_parameters(module)
        self._pending: dict[nn.Parameter, dist.Work] = {}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._launch)
            for p in module.parameters()
            if p.requires_grad
        ]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _launch(self, param: nn.Parameter) -> None:
        param.grad.div_(self.world_size)
        self._pending[param] = dist.all_reduce(param.grad, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every launched all-reduce; all-reduce the parameters that got no gradient
        (with zeros, in registration order, the same on every rank)."""
        for p in self.module.parameters():
            if p.requires_grad and p not in self._pending:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._launch(p)
        for work in self._pending.values():
            work.wait()
        self._pending.clear()


# ------------------------------------------------------------------------------- step 4
def bucket_assignment(param_bytes: Sequence[int], cap_bytes: float) -> list[list[int]]:
    """Group parameters into buckets: ``param_bytes[i]`` is parameter i's gradient size in
    bytes, in registration order; returns lists of indices, first bucket first.

    Buckets are filled in *reverse* registration order, because backward produces the last
    layer's gradients first. A bucket takes parameters while its size stays within
    ``cap_bytes``; a parameter larger than the cap gets a bucket of its own (torch's DDP would
    let it spill into the current bucket). ``cap_bytes=0`` gives one bucket per parameter.
    """
    if cap_bytes < 0:
        raise ValueError(f"the bucket cap must be 0 or more bytes, got {cap_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(param_bytes))):
        if current and size + param_bytes[i] > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += param_bytes[i]
    if current:
        buckets.append(current)
    return buckets


@dataclass(eq=False)
class Bucket:
    """Gradients that travel together: one flat tensor ``buffer`` whose slices are the
    ``params``' gradients (``offsets[i]`` is where ``params[i]`` starts)."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(default_factory=list)
    ready: list[bool] = field(default_factory=list)  # which gradients arrived this step
    pending: int = 0  # gradients still to come in this step
    work: dist.Work | None = None  # the all-reduce in flight, if launched

    def __post_init__(self) -> None:
        self.views = [
            self.buffer[o : o + p.numel()].view_as(p)
            for p, o in zip(self.params, self.offsets, strict=True)
        ]
        self.reset()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def take_gradient(self, i: int) -> None:
        """Make ``params[i].grad`` a view of this bucket, copying it in if autograd put it in
        a tensor of its own (after ``zero_grad(set_to_none=True)``); zeros if there is none."""
        p, view = self.params[i], self.views[i]
        if p.grad is None:
            view.zero_()
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view


@dataclass
class BucketTiming:
    """One bucket in one step: seconds since backward started (see :func:`timed_backward`)."""

    index: int
    nbytes: int
    launched_s: float
    completed_s: float


@dataclass
class StepTimeline:
    """When backward ended and each bucket's all-reduce was launched and completed; chapter 7
    plots it with :func:`dpcourse.viz_ddp.plot_timeline`."""

    backward_s: float
    finished_s: float
    buckets: list[BucketTiming]


class BucketManager:
    """The reducer: puts parameters into buckets, counts the gradients that have arrived, and
    launches each bucket's all-reduce, in bucket order, once all its gradients are in.

    Buckets are launched strictly in index order on every rank: collectives are matched by
    the order in which ranks call them, so a rank that launched bucket 1 before bucket 0 would
    pair its bucket 1 with another rank's bucket 0.
    """

    def __init__(self, params: Sequence[nn.Parameter], cap_bytes: float, world_size: int) -> None:
        self.world_size = world_size
        self.buckets: list[Bucket] = []
        self.where: dict[nn.Parameter, tuple[Bucket, int]] = {}
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:  # a flat buffer holds one dtype
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            sizes = [p.numel() * p.element_size() for p in group]
            for indices in bucket_assignment(sizes, cap_bytes):
                members = [group[i] for i in indices]
                offsets = [sum(p.numel() for p in members[:k]) for k in range(len(members))]
                total = offsets[-1] + members[-1].numel()
                buffer = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
                bucket = Bucket(len(self.buckets), members, offsets, buffer)
                self.buckets.append(bucket)
                for k, p in enumerate(members):
                    self.where[p] = (bucket, k)
                    p.grad = bucket.views[k] if p.grad is None else p.grad
        self.next_to_launch = 0
        self.ready_in_backward = 0  # gradients marked ready since the last finish()
        self.t0: float | None = None  # set by timed_backward: record a timeline
        self.timings: list[BucketTiming] = []

    def mark_ready(self, param: nn.Parameter, launch: bool) -> None:
        """``param``'s gradient is complete: move it into its bucket, and if ``launch``,
        start every bucket that is now full and next in line."""
        bucket, k = self.where[param]
        if bucket.ready[k]:
            raise RuntimeError(
                "a parameter received its gradient twice before finish_gradient_synchronization()"
                ": call backward once per step, or accumulate inside ddp.no_sync() and call "
                "finish_gradient_synchronization() after the last backward"
            )
        bucket.ready[k] = True
        bucket.take_gradient(k)
        bucket.pending -= 1
        self.ready_in_backward += 1
        if launch:
            while (
                self.next_to_launch < len(self.buckets)
                and self.buckets[self.next_to_launch].pending == 0
            ):
                self._launch(self.buckets[self.next_to_launch])

    def _launch(self, bucket: Bucket) -> None:
        bucket.buffer.div_(self.world_size)  # mean = sum of (gradient / N)
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self.next_to_launch = bucket.index + 1
        if self.t0 is not None:
            timing = BucketTiming(bucket.index, bucket.nbytes, time.perf_counter() - self.t0, -1.0)
            self.timings.append(timing)
            t0 = self.t0

            def done(fut, timing=timing, t0=t0):
                timing.completed_s = time.perf_counter() - t0
                return None

            bucket.work.get_future().then(done)

    def finish(self) -> None:
        """Launch the buckets still waiting (missing gradients count as zeros), wait for all,
        and reset for the next step."""
        for bucket in self.buckets[self.next_to_launch :]:
            for k, ready in enumerate(bucket.ready):
                if not ready:
                    bucket.take_gradient(k)
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.reset()
        self.next_to_launch = 0
        self.ready_in_backward = 0


class DDP(nn.Module):
    """DistributedDataParallel from scratch (chapter 7, step 4): bucketed, overlapped.

    ``DDP(module)`` broadcasts rank 0's parameters and buffers, then puts the gradients of the
    parameters that require one into buckets of at most ``bucket_cap_mb`` MiB (reverse
    registration order; ``0`` gives one bucket per parameter). During backward a hook per
    parameter moves its gradient into its bucket; with ``overlap=True`` a full bucket's
    all-reduce starts at once, asynchronously, while backward goes on; with ``overlap=False``
    every bucket is sent after backward. Gradients are averaged over the ranks.

    A training step::

        loss = loss_fn(ddp(x), y)
        loss.backward()
        ddp.finish_gradient_synchronization()   # wait for the all-reduces
        optimizer.step()

    ``forward`` passes through to ``module`` (``ddp.module``; its ``state_dict`` is unchanged).
    With ``broadcast_buffers=True``, as in torch's DDP, rank 0's buffers are broadcast before
    every forward. Inside ``with ddp.no_sync():`` backward only accumulates local gradients.
    The module must be on one device (``dpcourse.runtime.device()``) and a process group must
    be initialised (``dpcourse.launch.run_ranks`` or torchrun).
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        overlap: bool = True,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        if not bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb must be 0 or more, got {bucket_cap_mb}")
        device = _check_module(module, "DDP")
        _check_process_group("DDP")
        self.module = module
        self.overlap = overlap
        self.broadcast_buffers = broadcast_buffers and any(True for _ in module.buffers())
        self.world_size = dist.get_world_size()
        _check_same_model_on_every_rank(module, device)
        params = [p for p in module.parameters() if p.requires_grad]
        broadcast_parameters(module)
        self.reducer = BucketManager(params, bucket_cap_mb * MB, self.world_size)
        self.require_backward_grad_sync = True
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    def _hook(self, param: nn.Parameter) -> None:
        if self.require_backward_grad_sync:
            self.reducer.mark_ready(param, launch=self.overlap)

    def forward(self, *args, **kwargs):
        if self.reducer.ready_in_backward:
            raise RuntimeError(
                "forward was called again after a backward whose gradients were not "
                "synchronised: call ddp.finish_gradient_synchronization() after backward and "
                "before optimizer.step() (or run the backward inside ddp.no_sync())"
            )
        if self.broadcast_buffers and self.world_size > 1:
            broadcast_buffers(self.module)
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient is averaged over the ranks; call it after backward and
        before ``optimizer.step()``. Buckets not launched during backward (overlap off, or
        parameters that got no gradient on this rank) are launched now, zeros standing for
        missing gradients, the same way on every rank."""
        if not self.require_backward_grad_sync:
            raise RuntimeError(
                "finish_gradient_synchronization() was called inside ddp.no_sync(), where "
                "gradients only accumulate locally. Call it after the backward that runs "
                "outside no_sync()."
            )
        self.reducer.finish()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients on this rank (gradient
        accumulation); the first backward outside synchronises the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous


def timed_backward(ddp: DDP, loss: torch.Tensor) -> StepTimeline:
    """``loss.backward()`` and ``ddp.finish_gradient_synchronization()``, recording when each
    bucket's all-reduce was launched and completed, relative to the start of backward.

    Completion is when the backend reported it (a callback on the all-reduce's future): exact
    for gloo; for NCCL it can be earlier than the GPU's work (use torch.profiler there).
    """
    reducer = ddp.reducer
    reducer.timings = []
    reducer.t0 = t0 = time.perf_counter()
    try:
        loss.backward()
        backward_s = time.perf_counter() - t0
        ddp.finish_gradient_synchronization()
        finished_s = time.perf_counter() - t0
    finally:
        reducer.t0 = None
    deadline = time.perf_counter() + 1.0
    while any(t.completed_s < 0 for t in reducer.timings) and time.perf_counter() < deadline:
        time.sleep(1e-4)  # the callbacks may run a moment after wait() returns
    return StepTimeline(backward_s, finished_s, sorted(reducer.timings, key=lambda t: t.index))


# ------------------------------------------------------------------------------- sampling
def epoch_indices(
    num_samples: int, world_size: int, rank: int, epoch: int, seed: int = 0, shuffle: bool = True
) -> list[int]:
    """The sample indices ``DistributedSampler(num_replicas=world_size, rank=rank, seed=seed)``
    yields after ``set_epoch(epoch)``: a permutation seeded with ``seed + epoch``, padded by
    repeating its start to a multiple of ``world_size``, then every ``world_size``-th index
    from ``rank`` on. Chapter 7 shows the order repeating when ``set_epoch`` is forgotten."""
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(num_samples, generator=g).tolist()
    else:
        order = list(range(num_samples))
    total = math.ceil(num_samples / world_size) * world_size  # every rank gets as many
    padding = total - num_samples
    order += (order * math.ceil(padding / num_samples))[:padding]  # repeat from the start
    return order[rank:total:world_size]
