"""Fully sharded data parallelism (ZeRO stage 3) from scratch (chapter 9).

ZeRO stages 1 and 2 (:mod:`dpcourse.sharding.zero`) shard the optimizer state and the gradients,
but every rank still holds every parameter. Stage 3 shards the parameters too, as torch's FSDP2
(``fully_shard``) does. :class:`FSDPCore` is the idea in four steps, the code section 9.11 shows:

1. **shard**: each parameter of a sharded layer is cut along dim 0 into N shards; between uses
   the module holds only this rank's rows, as fp32 master weights
   (:mod:`dpcourse.sharding.fsdp_layer`), and an optimizer built on ``fsdp.parameters()`` keeps
   1/N of every state: ZeRO-3 is FSDP plus any torch optimizer;
2. **gather, compute, free**: a layer's forward pre-hook all-gathers its parameters, its forward
   hook frees them;
3. **backward**: the gradient of a layer's output arrives just before the layer's backward, and
   a hook on it gathers the layer again; once every trainable parameter of the layer has its
   gradient, they are reduce-scattered, averaged, added to the shards' ``.grad``, and the full
   parameters are freed (ZeRO-3's order: gather, compute, free; reduce-scatter, free);
4. **prefetch**: every collective runs on one communication thread, in the order the hooks
   submit them (the same on every rank; :mod:`dpcourse.sharding.fsdp_comm`). With
   ``prefetch=True`` a layer's pre-hook also submits the next layer's all-gather (the previous
   layer's, in backward), so it is on the wire while this layer computes: at most two layers are
   gathered at a time.

Parameters outside the sharded layers stay replicated; their gradients are all-reduced in
:meth:`FSDPCore.finish_gradient_synchronization`. A step is
``loss.backward(); fsdp.finish_gradient_synchronization(); optimizer.step()``.

:class:`FSDP` is what a training loop takes, ``fully_shard``'s design with its knobs: the core
with layers on top, each a class that overrides one step of the core and calls it, each taught
where the book shows it. On a GPU, the collectives on streams of their own
(:class:`~dpcourse.sharding.fsdp_comm.StreamedCommThread`, section 9.11); the gradients as
torch's utilities expect them, every rank agreeing on unused parameters and on an overflow, and
clipping by the global norm (:class:`~dpcourse.sharding.shard_grads.AgreeOnGradients`,
:meth:`FSDP.clip_grad_norm_`, section 9.11); mixed precision, resharding after forward,
accumulation without synchronising and recomputation under activation checkpointing
(:mod:`dpcourse.sharding.fsdp_options`, sections 11.2-11.5); sharding over a sub-group, replicated
across such groups (``shard_group``, ``replicate_group``: hybrid sharding,
:mod:`dpcourse.sharding.hsdp`, section 11.7). A model built on the ``meta`` device is sharded
without memory, and :meth:`FSDP.materialize` then makes each rank's rows only
(:mod:`dpcourse.sharding.meta_init`); CPU offload is a subclass
(:mod:`dpcourse.sharding.fsdp_offload`).

Chapter 9: ZeRO stage 3 / FSDP from scratch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.collectives.p2p import rank_and_size
from dpcourse.collectives.ring import ring_all_reduce
from dpcourse.collectives.tree import tree_broadcast
from dpcourse.one_device.memory import tensors_in
from dpcourse.sharding import shard_grads
from dpcourse.sharding.fsdp_comm import CommWork, comm_thread
from dpcourse.sharding.fsdp_layer import ShardedLayer
from dpcourse.sharding.fsdp_options import (
    Accumulation,
    MixedPrecision,
    Recomputation,
    ReshardAfterForward,
    precision,
)

__all__ = ["FSDPCore", "FSDP"]


class FSDPCore(nn.Module):
    """``FSDPCore(model, layers=None, prefetch=True)``, on every rank: chapter 9's four steps.

    ``layers``: names of the submodules to shard, each a unit that is gathered whole (by
    default every direct child that has parameters); parameters outside them stay replicated.
    Every rank must run the same graph, and the layers run in the same order in every forward
    (the first forward records it). The layout's other arguments are set by the layers on top
    (:class:`FSDP`): ``param_dtype``, the dtype the layers are gathered and compute in (None:
    the parameters'); ``reduce_dtype``, the one their gradients are reduced in; ``shard_group``
    and ``replicate_group``, the ranks that shard each layer (None: every rank) and the ranks
    that hold the same rows (hybrid sharding, chapter 11).
    """

    def __init__(self, module: nn.Module, *, layers: Iterable[str] | None = None,
                 prefetch: bool = True, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype = torch.float32, shard_group: Any = None,
                 replicate_group: Any = None) -> None:
        super().__init__()
        self.rank, self.world_size = rank_and_size()  # a clear error without a process group
        self.module, self.prefetch = module, prefetch
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_rank, self.shard_size, replicas = _group_layout(shard_group, replicate_group)
        devices = {t.device for t in [*module.parameters(), *module.buffers()]}
        self.device = next(iter(devices), torch.device("cpu"))
        if self.world_size > 1 and self.device.type != "meta":  # meta: no values yet
            for t in [*module.parameters(), *module.buffers()]:  # the replicas start equal
                tree_broadcast(t.data, src=0)
        modules = dict(module.named_modules())
        names = default_layers(module) if layers is None else list(layers)
        sharded = {id(p) for n in names for p in modules[n].parameters()}
        self.replicated = [p for p in module.parameters() if id(p) not in sharded]
        self.layers = [ShardedLayer.shard(n, modules[n], self.shard_rank, self.shard_size,
                                          param_dtype, reduce_dtype=reduce_dtype,
                                          group=shard_group, replicate_group=replicate_group,
                                          replicas=replicas)
                       for n in names]
        self.comm = comm_thread(self.device)
        self._order: list[ShardedLayer] = []  # forward order, recorded by the first forward
        self._recorded = False
        self._pending: list[CommWork] = []  # reduce-scatters submitted in this backward
        self.calls: Counter[str] = Counter()  # all-gathers and reduce-scatters submitted
        # this rank's reduced rows not all finite (an fp16 overflow), set by the reduce-scatters
        # on the device (no host sync); chapter 9's GradScaler layer reads it
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        for layer in self.layers:
            layer.module.register_forward_pre_hook(
                lambda module, args, layer=layer: self._pre_forward(layer, args))
            layer.module.register_forward_hook(
                lambda module, args, out, layer=layer: self._post_forward(layer, out))
            self._watch_gradients(layer)

    def _watch_gradients(self, layer: ShardedLayer) -> None:
        """Count the layer's gradients as backward makes them (:meth:`_grad_arrived`)."""
        for i in layer.trainable():
            layer.full[i].register_post_accumulate_grad_hook(
                lambda param, layer=layer: self._grad_arrived(layer))

    # ----------------------------------------------------------------- the hooks: forward
    def _pre_forward(self, layer: ShardedLayer, args: tuple) -> tuple:
        if not self._recorded:
            self._order.append(layer)  # the first forward records the order
        self._unshard(layer)
        if self.prefetch and (nxt := self._neighbour(layer, +1)) is not None:
            self._gather(nxt)  # on the wire while this layer computes
        layer.use_full(True)
        return args

    def _gather(self, layer: ShardedLayer) -> None:
        if layer.gather is None and not layer.full_bytes():  # not here, nor on its way
            self.calls["all-gather"] += 1
            layer.gather = self.comm.submit(layer.all_gather, layer.gather_buffer())

    def _unshard(self, layer: ShardedLayer) -> None:
        self._gather(layer)  # nothing if gathered, or on its way (prefetched)
        if layer.gather is not None:
            layer.copy_out(layer.gather.wait())  # here (on a GPU: queued)
            layer.gather = None  # its buffer goes (the compute stream waited)

    def _post_forward(self, layer: ShardedLayer, output: Any) -> None:
        layer.use_full(False)
        self._reshard(layer)
        for t in tensors_in(output):  # their gradient: backward is here
            if t.requires_grad:
                t.register_hook(lambda grad: self._pre_backward(layer))

    def _reshard(self, layer: ShardedLayer) -> None:
        layer.free()  # the full parameters' memory, until backward gathers

    def _neighbour(self, layer: ShardedLayer, step: int) -> ShardedLayer | None:
        if not self._recorded or layer not in self._order:
            return None
        i = self._order.index(layer) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    # ---------------------------------------------------------------- the hooks: backward
    def _pre_backward(self, layer: ShardedLayer) -> None:
        if layer.reduced:
            return
        self._unshard(layer)
        if self.prefetch and (prev := self._neighbour(layer, -1)) is not None:
            if not prev.reduced:
                self._gather(prev)  # backward runs the layers in reverse

    def _grad_arrived(self, layer: ShardedLayer) -> None:
        layer.arrived += 1
        trainable = len(layer.trainable())
        if layer.arrived == trainable:  # its backward is over
            self._reduce(layer)
            if trainable == len(layer.full):  # nothing frozen
                layer.use_full(False)
                layer.free()

    def _reduce(self, layer: ShardedLayer) -> None:
        layer.reduced = True
        self.calls["reduce-scatter"] += 1
        if self._pending:  # as FSDP2: the last one's input may go (on a GPU)
            self._pending[-1].release()
        flat = layer.pack_grads()  # the gradients, rank by rank
        work = self.comm.submit(layer.reduce_scatter, flat, self._nonfinite,
                                stream="reduce-scatter")
        self._pending.append(work)

    # ------------------------------------------------------------------------- the step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for layer in self.layers:
            layer.arrived, layer.reduced = 0, False
            if layer.gather is not None or layer.full_bytes():  # kept from a forward whose
                layer.free()  # backward never ran (evaluation, reshard_after_forward=False)
        out = self.module(*args, **kwargs)
        self._recorded = True
        return out

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter (reduce-scatter the layers whose gradients did not all
        arrive: a missing gradient counts as zero), average the replicated parameters'
        gradients, and free the layers. Afterwards every shard's ``.grad`` is its rows of the
        average."""
        for layer in self.layers:
            if not layer.reduced and layer.trainable():
                self._reduce(layer)
        for work in self._pending:  # the reduce-scatters: this rank's rows
            work.wait()
        self._pending.clear()
        replicated = [p for p in self.replicated if p.requires_grad]
        if replicated and self.world_size > 1:  # their gradients, averaged in one flat ring
            flat = _flat_grads(replicated)
            self.comm.submit(ring_all_reduce, flat, "mean", False, stream="reduce-scatter").wait()
            _set_grads(replicated, flat)
        for layer in self.layers:
            layer.use_full(False)
            layer.free()

    # --------------------------------------------------------------------- whole weights
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (the fp32 masters gathered) and every buffer, keyed by the
        wrapped module's own names, so it loads into the unwrapped model. Every rank must call
        it (it all-gathers); every rank gets it."""
        state = self.module.state_dict()
        for layer in self.layers:
            whole = [torch.empty(f.shape, dtype=torch.float32, device=f.device)
                     for f in layer.full]
            flat = self.comm.submit(layer.all_gather, layer.gather_buffer(torch.float32)).wait()
            layer.copy_out(flat, whole)
            for name, tensor in zip(layer.param_names, whole, strict=True):
                state[f"{layer.name}.{name}"] = tensor
        return state

    def gathered_bytes(self) -> int:
        """Bytes of full parameters this rank holds now, or is gathering (a prefetch in flight
        counts: its memory is being filled)."""
        return sum(layer.unsharded_bytes() for layer in self.layers)

    def close(self) -> None:
        """Stop the communication thread (it also stops with the process)."""
        self.comm.close()


class FSDP(Accumulation, shard_grads.AgreeOnGradients, Recomputation, ReshardAfterForward,
           MixedPrecision, FSDPCore):
    """``FSDP(module, layers=None, compute_dtype=None, prefetch=True)``, on every rank: the core
    (:class:`FSDPCore`) with ``fully_shard``'s knobs and what torch's loop expects, as layers.

    ``layers``: names of the submodules to shard, each a unit that is gathered whole (by
    default every direct child that has parameters); parameters outside them stay replicated.
    Every rank must run the same graph, and the layers run in the same order in every forward
    (the first forward records it). ``compute_dtype`` (``torch.float16`` or ``bfloat16``): the
    sharded layers compute in it, on inputs cast to it; the masters and the gradient reduction
    stay fp32. ``fsdp.module.named_parameters()`` are the shards and the replicated parameters.
    After :meth:`finish_gradient_synchronization` a parameter that no rank used has the gradient
    it had before this backward, and if any rank's reduced gradients were not finite every
    rank's are (:class:`~dpcourse.sharding.shard_grads.AgreeOnGradients`); clip with
    :meth:`clip_grad_norm_`.

    Chapter 11's knobs (keyword arguments; :mod:`dpcourse.sharding.fsdp_options`):

    * ``mp_policy``: torch's ``MixedPrecisionPolicy`` (or any object with its fields
      ``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``), read as
      ``fully_shard`` reads it: the layers are gathered and compute in ``param_dtype``; the
      gradients are reduced in ``reduce_dtype``, which defaults to ``param_dtype`` (not to fp32,
      as ``compute_dtype`` does), and in fp16 divided by about sqrt(N) before the sum and by the
      rest after, as ``fully_shard`` divides them (:func:`~dpcourse.sharding.fsdp_layer.
      divide_factors`); the wrapped model's floating-point outputs are cast to
      ``output_dtype``. Not together with ``compute_dtype``.
    * ``reshard_after_forward``: False keeps a layer's gathered parameters from its forward
      until its gradients are reduced, so backward does not gather it again.
    * ``shard_group``, ``replicate_group``: shard over the ranks of ``shard_group`` only (a
      ``dist.new_group`` that holds this rank), and sum each reduced chunk over
      ``replicate_group`` (the ranks that hold the same rows): hybrid sharding. By default every
      rank is in one shard group.
    * :meth:`set_requires_gradient_sync` and :meth:`no_sync`: gradient accumulation without
      synchronising; :meth:`in_backward`: a forward run again by activation checkpointing.

    The shards may live on another device than the layers compute on (chapter 11's CPU offload,
    :class:`dpcourse.sharding.fsdp_offload.OffloadedFSDP`): the all-gather copies them in, the
    reduce-scatter's rows go back to where they are.
    """

    def __init__(self, module: nn.Module, *, layers: Iterable[str] | None = None,
                 compute_dtype: torch.dtype | None = None, prefetch: bool = True,
                 mp_policy: Any = None, reshard_after_forward: bool = True,
                 shard_group: Any = None, replicate_group: Any = None) -> None:
        _check_arguments(module, layers, compute_dtype, mp_policy, reshard_after_forward,
                         shard_group, replicate_group)
        super().__init__(module, layers=layers, compute_dtype=compute_dtype, prefetch=prefetch,
                         mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                         shard_group=shard_group, replicate_group=replicate_group)
        self._needs_sync = False  # a backward's gradients wait for finish_gradient_sync...

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._needs_sync:
            raise RuntimeError(
                "forward was called again before the previous backward's gradients were "
                "synchronised: call fsdp.finish_gradient_synchronization() after backward and "
                "before optimizer.step() (or, to accumulate gradients over micro-batches "
                "without synchronising, run their forward and backward in `with fsdp.no_sync():`)"
            )
        out = super().forward(*args, **kwargs)
        self._needs_sync = self._sync and any(t.requires_grad for t in tensors_in(out))
        return out

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter; reduce-scatter the layers whose gradients did not all
        arrive (a missing gradient counts as zero) and all-reduce the replicated parameters'
        gradients (averaged). Afterwards every shard's ``.grad`` is its rows of the average (a
        :class:`~dpcourse.sharding.shard_grads.ShardGrad`); if any rank's reduced gradients were
        not finite, every rank's are (a NaN in each), so that a ``GradScaler`` skips the step on
        every rank; a parameter that no rank used has the gradient it had before this backward
        (``None`` after ``zero_grad``)."""
        super().finish_gradient_synchronization()
        self._needs_sync = False

    def clip_grad_norm_(self, max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that the whole model's gradient has a
        ``norm_type``-norm of at most ``max_norm``, and return that norm (a
        0-dim tensor, the same on every rank), as
        ``torch.nn.utils.clip_grad_norm_`` does on unsharded gradients (on our
        shards it would take each rank's own part, and refuses:
        :mod:`dpcourse.sharding.shard_grads`). Call it on every rank, after
        :meth:`finish_gradient_synchronization` (and after
        ``scaler.unscale_(optimizer)`` where a GradScaler scales the loss),
        before the step."""
        if self._needs_sync:
            raise RuntimeError(
                "clip_grad_norm_ before finish_gradient_synchronization: the "
                "gradients are not yet averaged; call "
                "fsdp.finish_gradient_synchronization() first")
        sharded = [s.grad for layer in self.layers for s in layer.shards
                   if s.grad is not None]
        whole = [p.grad for p in self.replicated if p.grad is not None]
        # the norm's memory made here, on the caller's stream
        norm = torch.zeros((), device=self.device)
        work = self.comm.submit(
            shard_grads.clip_grad_norm_, sharded, whole, max_norm,
            float(norm_type), self.shard_rank, self.shard_size,
            self.shard_group, norm, stream="reduce-scatter")
        return work.wait()

    def unsharded_grad_bytes(self) -> int:
        """Bytes of full gradients this rank holds now: those of a layer whose backward ran and
        whose gradients are not yet reduced, and those accumulated without synchronising."""
        return sum(sum(f.grad.numel() * f.grad.element_size() for f in layer.full
                       if f.grad is not None) + layer.accumulated_bytes()
                   for layer in self.layers)

    # -------------------------------------------------------------------- meta device
    @torch.no_grad()
    def materialize(self, device: torch.device | str,
                    init: Callable[[str, tuple[int, ...], int, int], torch.Tensor]) -> None:
        """Give a model built on the ``meta`` device its values, each rank making only what it
        keeps: ``init(name, shape, first_row, end_row)`` returns rows ``first_row:end_row`` of
        the parameter ``name`` (the wrapped model's name) of ``shape`` (its rows along dim 0; a
        0-dimensional parameter is one row), as fp32 or any dtype; it must give every rank the
        same rows for the same arguments. Sharded layers get this rank's rows, replicated
        parameters all of theirs; the full parameters get a device, and no memory until
        gathered. Buffers must not be on ``meta`` (give them values before wrapping). Build the
        optimizer afterwards: the parameters are new tensors. Chapter 11."""
        if self.device.type != "meta":
            raise RuntimeError(f"materialize is for a model built on the meta device; this one "
                               f"is on {self.device}")
        if any(b.is_meta for b in self.module.buffers()):
            raise ValueError("the model has buffers on the meta device: give them values (or "
                             "build them on the target device) before wrapping it")
        device = torch.device(device)
        for layer in self.layers:
            for i, pname in enumerate(layer.param_names):
                shard, full = layer.shards[i], layer.full[i]
                r0, r1 = layer.bounds[i][layer.rank]
                rows = _rows(init, f"{layer.name}.{pname}", tuple(full.shape), r0, r1)
                layer.shards[i] = nn.Parameter(rows.to(device, torch.float32).reshape(shard.shape),
                                               requires_grad=shard.requires_grad)
                layer.full[i] = nn.Parameter(torch.empty(full.shape, dtype=full.dtype,
                                                         device=device),
                                             requires_grad=full.requires_grad)
                layer.full[i].untyped_storage().resize_(0)  # no memory until gathered
            self._watch_gradients(layer)
            layer.use_full(False)  # the new shards into the module
        replicated = {id(p) for p in self.replicated}
        self.replicated = []
        for name, p in list(self.module.named_parameters()):
            if id(p) in replicated:
                shape = tuple(p.shape)
                values = _rows(init, name, shape, 0, shape[0] if shape else 1).reshape(shape)
                new = nn.Parameter(values.to(device, p.dtype), requires_grad=p.requires_grad)
                owner, _, attr = name.rpartition(".")
                self.module.get_submodule(owner)._parameters[attr] = new
                self.replicated.append(new)
        self.device = device
        self.comm.close()
        self.comm = comm_thread(device)
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=device)


# ------------------------------------------------------------------------------- helpers
def default_layers(module: nn.Module) -> list[str]:
    """FSDP's layers when none are named: every direct child of ``module`` with parameters."""
    return [n for n, c in module.named_children() if any(True for _ in c.parameters())]


def _group_layout(shard_group: Any, replicate_group: Any) -> tuple[int, int, int]:
    """(this rank in its shard group, the shard group's size, the replicate group's size)."""
    if shard_group is None:
        return dist.get_rank(), dist.get_world_size(), 1
    replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
    return dist.get_rank(shard_group), dist.get_world_size(shard_group), replicas


def _check_arguments(module: Any, layers: Iterable[str] | None, compute_dtype: Any,
                     mp_policy: Any, reshard_after_forward: Any, shard_group: Any,
                     replicate_group: Any) -> None:
    """FSDP's arguments, checked before anything is sharded, each error saying what to do."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FSDP wraps a torch.nn.Module (the model, on this rank's device), "
                        f"got {type(module).__name__}: FSDP(model), not "
                        "FSDP(model.parameters()) or FSDP(optimizer)")
    rank, world_size = rank_and_size()  # a clear error without a process group
    precision(compute_dtype, mp_policy)
    if not isinstance(reshard_after_forward, bool):
        raise TypeError("reshard_after_forward must be True or False (fully_shard's int, a "
                        f"smaller group to reshard to, is not supported), got "
                        f"{reshard_after_forward!r}")
    _check_groups(rank, world_size, shard_group, replicate_group)
    devices = sorted({str(t.device) for t in [*module.parameters(), *module.buffers()]})
    if len(devices) > 1:
        raise ValueError(f"the module is on several devices ({', '.join(devices)}): FSDP "
                         "shards a module on one device; move it with .to(device) first")
    children = default_layers(module)
    names = children if layers is None else list(layers)
    modules = dict(module.named_modules())
    for n in names:
        if n not in modules or n == "":
            raise ValueError(f"no submodule named {n!r} to shard; submodules with "
                             f"parameters: {', '.join(children)}")
    for a in names:
        for b in names:
            if a != b and b.startswith(a + "."):
                raise ValueError(f"layer {b!r} is inside layer {a!r}: shard one or the other")
    _check_not_shared(module, names)


def _check_groups(rank: int, world_size: int, shard_group: Any, replicate_group: Any) -> None:
    """The groups must hold this rank and multiply to the world size."""
    if shard_group is None:
        if replicate_group is not None:
            raise ValueError("replicate_group needs a shard_group: the ranks of a shard "
                             "group shard each layer, the replicate group sums across them")
        return
    shard_rank = dist.get_rank(shard_group)
    replicate_rank = 0 if replicate_group is None else dist.get_rank(replicate_group)
    if shard_rank < 0 or replicate_rank < 0:
        raise ValueError(f"rank {rank} is not in the shard_group or replicate_group it "
                         "was given: pass the groups this rank belongs to")
    replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
    if dist.get_world_size(shard_group) * replicas != world_size:
        raise ValueError(
            f"a shard group of {dist.get_world_size(shard_group)} ranks times a replicate "
            f"group of {replicas} is not the world's {world_size} ranks: every rank "
            "must hold one shard of one replica (HSDP's nodes x ranks per node)")


def _check_not_shared(module: nn.Module, names: list[str]) -> None:
    """A parameter used by two sharded layers (or by one and outside it) would be sharded
    twice or gathered in one and not the other: refuse it, naming where it is."""
    where: dict[int, set[str]] = {}
    label: dict[int, str] = {}
    for pname, p in module.named_parameters(remove_duplicate=False):
        home = next((n for n in names if pname.startswith(n + ".")), "(unsharded)")
        where.setdefault(id(p), set()).add(home)
        label.setdefault(id(p), pname)
    for pid, homes in where.items():
        if len(homes) > 1 and any(h != "(unsharded)" for h in homes):
            raise ValueError(
                f"parameter {label[pid]!r} is shared by {' and '.join(sorted(homes))}: a "
                "sharded layer gathers and frees its own parameters, so a shared one (tied "
                "weights) must be in one sharded layer with all its users, or left unsharded"
            )


def _rows(init: Callable, name: str, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
    """``init``'s rows ``r0:r1`` of the parameter ``name``, checked."""
    rows = init(name, shape, r0, r1)
    width = 1
    for d in shape[1:]:
        width *= d
    if not isinstance(rows, torch.Tensor) or rows.numel() != (r1 - r0) * width:
        got = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"init({name!r}, {shape}, {r0}, {r1}) must return rows {r0}:{r1} of a "
                         f"parameter of shape {shape}: {(r1 - r0) * width} values, got {got}")
    return rows.detach()


def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """The parameters' gradients end to end in fp32 (a missing gradient counts as zeros)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in params])


def _set_grads(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Give each parameter its piece of ``flat`` as its gradient, in its dtype."""
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
        offset += p.numel()
