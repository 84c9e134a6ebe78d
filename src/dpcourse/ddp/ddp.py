"""DistributedDataParallel from scratch, in the four steps of chapter 7.

1. :func:`broadcast_parameters`: at wrap time every rank takes rank 0's parameters and buffers,
   so ranks that were seeded differently start from the same model.
2. :func:`all_reduce_gradients`: after ``backward``, one all-reduce per parameter gradient,
   divided by the world size (the mean, as torch's DDP computes it).
3. :class:`PerParameterDDP`: the same all-reduces, launched asynchronously (``async_op=True``)
   from autograd hooks (``register_post_accumulate_grad_hook``) while backward is still running,
   and waited for in :meth:`~PerParameterDDP.finish_gradient_synchronization`.
4. :class:`BucketedDDP`: gradients grouped into buckets of about ``bucket_cap_mb``, one
   asynchronous all-reduce per bucket as soon as it is full (the buckets and the reducer,
   :class:`~dpcourse.ddp.buckets.BucketManager`, are in :mod:`dpcourse.ddp.buckets`).

:class:`DDP` is step 4 as torch's drop-in class: the core, plus the layers torch's DDP has (the
synchronisation finished by the end of backward, torch's arguments and their checks, unused
parameters as :mod:`dpcourse.ddp.unused` keeps them).

:func:`wrap` makes any of them (or torch's DDP) from its name. Each step is tested against
single-process training and torch's DDP (``tests/test_ddp.py``) and timed by ``python -m
dpcourse.harness.bench ddp``. The names follow PyTorch's DDP (Li et al., 2020).

Chapter 7: DistributedDataParallel from scratch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from dpcourse.ddp.buckets import MB, Bucket, BucketManager, HookedBucketManager
from dpcourse.ddp.checks import (
    check_bucket_cap,
    check_module,
    check_process_group,
    check_same_model_on_every_rank,
    check_torch_options,
)
from dpcourse.ddp.unused import HookedKeepUnused, KeepUnused

__all__ = ["broadcast_parameters", "broadcast_buffers", "all_reduce_gradients",
           "PerParameterDDP", "BucketedDDP", "DDP", "VARIANTS", "wrap"]


# ------------------------------------------------------------------------------- step 1
def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Step 1: copy rank ``src``'s parameters and buffers to every rank, in
    place. One broadcast per tensor, in registration order (the same on
    every rank). Afterwards the ranks hold the same model, however each was
    initialised. Chapter 7, step 1."""
    check_process_group("broadcast_parameters")
    check_module(module, "broadcast_parameters")
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
    """Step 2: after ``backward``, replace every gradient by its mean over
    the ranks. One (blocking) all-reduce per parameter that requires a
    gradient, in registration order. A parameter that got no gradient on
    this rank takes part with zeros, so that every rank runs the same
    all-reduces and none waits forever. Chapter 7, step 2."""
    check_process_group("all_reduce_gradients")
    world = dist.get_world_size()
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.div_(world)  # first, as torch's DDP does: the sum is a mean
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
        check_module(module, "PerParameterDDP")
        check_process_group("PerParameterDDP")
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
        """Wait for every launched all-reduce; all-reduce the parameters that
        got no gradient (with zeros, in registration order, the same on every
        rank)."""
        for p in self.module.parameters():
            if p.requires_grad and p not in self._pending:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._launch(p)
        for work in self._pending.values():
            work.wait()
        self._pending.clear()


# ------------------------------------------------------------------------------- step 4
class BucketedDDP(nn.Module):
    """Step 4, the core: gradients in buckets, each all-reduced as soon as it is full.

    ``BucketedDDP(module)`` makes every rank start from rank 0's parameters (``start``, step 1),
    puts the gradients of the parameters that require one into buckets of ``bucket_cap_mb``
    MiB (:class:`~dpcourse.ddp.buckets.BucketManager`, the ``reducer``), and registers a hook per
    parameter that hands its finished gradient to the reducer. With ``overlap=True`` a full
    bucket's all-reduce starts at once, while backward goes on; with ``overlap=False`` every
    bucket leaves in :meth:`finish_gradient_synchronization`, which the training loop calls
    after ``backward`` and before ``optimizer.step()``. With ``broadcast_buffers`` rank 0's
    buffers are broadcast before every forward; inside ``no_sync()`` gradients only accumulate.
    Chapter 7, step 4. :class:`DDP` is torch's drop-in class on top of it.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25.0,
        *,
        overlap: bool = True,
        broadcast_buffers: bool = True,
        start: Callable[[nn.Module], None] = broadcast_parameters,
        reducer: type[BucketManager] = BucketManager,
    ) -> None:
        super().__init__()
        self.module, self.overlap, self.world_size = module, overlap, dist.get_world_size()
        self.broadcast_buffers = broadcast_buffers and any(True for _ in module.buffers())
        start(module)  # step 1: the same parameters and buffers on every rank
        params = [p for p in module.parameters() if p.requires_grad]
        self.reducer = reducer(params, bucket_cap_mb * MB, self.world_size)
        self.require_backward_grad_sync = True  # False inside no_sync()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    def _hook(self, param: nn.Parameter) -> None:
        if self.require_backward_grad_sync:  # in no_sync() it stays here
            self.reducer.mark_ready(param, launch=self.overlap)

    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world_size > 1:
            broadcast_buffers(self.module)
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets not launched during backward (zeros for the gradients that never
        came), and wait until every gradient is averaged over the ranks."""
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


def _keep_own_parameters(module: nn.Module) -> None:
    """torch's ``init_sync=False``: every rank keeps the parameters it has."""


class DDP(BucketedDDP):
    """DistributedDataParallel from scratch, drop-in for torch's: :class:`BucketedDDP` and the
    layers a torch training loop expects of it.

    A training step, as with torch's DDP::

        loss = loss_fn(ddp(x), y)
        loss.backward()      # ends by waiting for the all-reduces (as in torch's DDP)
        optimizer.step()

    What it adds to the core: the gradients are averaged by the end of every backward outside
    ``no_sync()`` (a callback queued on the autograd engine, as torch's DDP does), so calling
    :meth:`finish_gradient_synchronization` is optional, and calling it again does nothing; a
    misuse (a forward after a backward that did not finish, a finish inside ``no_sync()``) is an
    error that says what to do; and torch's arguments, in torch's order, so that
    ``DDP(model, device_ids=[i])`` runs unchanged (``overlap``, keyword-only, is the course's
    own). Where they mean something here they act as in torch: ``bucket_cap_mb=None`` is 25,
    ``init_sync=False`` skips the first broadcast, ``device_ids`` and ``output_device`` must
    name the module's device, ``dim`` must be 0 and ``process_group`` the default group, and
    ``find_unused_parameters=True`` leaves a parameter that no rank used with the gradient it
    had (:class:`~dpcourse.ddp.unused.KeepUnused`), where by default it is averaged as zeros
    (torch's DDP stops with an error instead). Two are accepted with one behaviour only:
    gradients are always views of the buckets (``gradient_as_bucket_view=True`` in torch's
    words), and the buckets are never rebuilt (``static_graph``). Any other argument is
    refused, by name. The module must be on one device (``dpcourse.runtime.device()``), every
    rank must wrap the same model, and a process group must be initialised
    (``dpcourse.harness.launch.run_ranks`` or torchrun).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        overlap: bool = True,
        **unsupported: object,
    ) -> None:
        bucket_cap_mb = check_bucket_cap(bucket_cap_mb)
        device = check_module(module, "DDP")
        check_process_group("DDP")
        check_torch_options(device, device_ids, output_device, dim,
                            process_group, unsupported)
        check_same_model_on_every_rank(module, device)
        super().__init__(
            module, bucket_cap_mb, overlap=overlap,
            broadcast_buffers=broadcast_buffers,
            start=broadcast_parameters if init_sync else _keep_own_parameters,
            reducer=KeepUnused if find_unused_parameters else BucketManager,
        )
        self._finish_queued = False  # a callback waits for backward's end
        self._synchronised = False  # the last backward's are averaged

    def _hook(self, param: nn.Parameter) -> None:
        if self.require_backward_grad_sync and not self._finish_queued:
            # As torch's DDP does: the autograd engine finishes the
            # synchronisation once this backward is over, so that
            # `loss.backward(); optimizer.step()` is right.
            engine = Variable._execution_engine
            engine.queue_callback(self.finish_at_end_of_backward)
            self._finish_queued, self._synchronised = True, False
        super()._hook(param)

    def finish_at_end_of_backward(self) -> None:
        """What the autograd engine calls once backward is done: the reducer
        finishes."""
        self._finish_queued = False
        self.reducer.finish()
        self._synchronised = True

    def forward(self, *args, **kwargs):
        if self._finish_queued:  # a backward began synchronising and never reached its end
            raise RuntimeError(
                "forward was called again after a backward whose gradients were not "
                "synchronised: call ddp.finish_gradient_synchronization() after backward and "
                "before optimizer.step() (or run the backward inside ddp.no_sync())"
            )
        # a new step: a rank whose backward then reaches none of the parameters (no hook, no
        # callback) must still join the all-reduces in finish_gradient_synchronization()
        self._synchronised = False
        return super().forward(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient is averaged over the ranks. Buckets not launched during
        backward (overlap off, or parameters that got no gradient on this rank) are launched
        now, zeros standing for missing gradients, the same way on every rank.

        The end of every backward outside :meth:`no_sync` runs it already (a callback queued
        on the autograd engine by the first gradient hook, as torch's DDP does), so a
        torch-style ``loss.backward(); optimizer.step()`` is right as it is; calling it again
        before the next backward does nothing. Chapter 7 calls it by hand to show the step."""
        if not self.require_backward_grad_sync:
            raise RuntimeError(
                "finish_gradient_synchronization() was called inside ddp.no_sync(), where "
                "gradients only accumulate locally. Call it after the backward that runs "
                "outside no_sync()."
            )
        if not self._synchronised:
            self._finish_queued = False
            super().finish_gradient_synchronization()
            self._synchronised = True

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Replace each bucket's all-reduce by ``hook(state, bucket)``, as torch's DDP's
        ``register_comm_hook`` does: ``bucket`` has the methods of ``dist.GradBucket``
        (:class:`~dpcourse.ddp.buckets.HookBucket`), and the hook returns a
        ``torch.futures.Future`` whose value is the bucket's averaged gradients (the hook
        divides by the world size). Chapter 12's compression hooks run here and on torch's."""
        if isinstance(self.reducer, HookedBucketManager):
            raise RuntimeError("register_comm_hook can be called once, as in torch's DDP")
        hooked = HookedKeepUnused if isinstance(self.reducer, KeepUnused) else HookedBucketManager
        self.reducer = hooked(self.reducer, hook, state)


# ------------------------------------------------------------------------------ variants
VARIANTS = ("none", "step 2", "step 3", "DDP", "torch DDP")


def wrap(variant: str, module: nn.Module, **options) -> tuple[nn.Module, Callable[[], None]]:
    """``module`` prepared as one of ``VARIANTS``: ``"none"`` (no communication), ``"step 2"``,
    ``"step 3"``, ``"DDP"`` or ``"torch DDP"`` (``options`` go to :class:`DDP` or torch's
    ``DistributedDataParallel``). Returns ``(wrapped, finish)``: forward through ``wrapped``;
    call ``finish()`` after backward, before ``optimizer.step()``."""
    if variant == "none":
        return module, lambda: None
    if variant == "step 2":
        broadcast_parameters(module)
        return module, lambda: all_reduce_gradients(module)
    if variant == "step 3":
        wrapped = PerParameterDDP(module)
        return wrapped, wrapped.finish_gradient_synchronization
    if variant == "DDP":
        wrapped = DDP(module, **options)
        return wrapped, wrapped.finish_gradient_synchronization
    if variant == "torch DDP":
        return nn.parallel.DistributedDataParallel(module, **options), lambda: None
    raise ValueError(f"unknown variant {variant!r}; the variants are {VARIANTS}")
