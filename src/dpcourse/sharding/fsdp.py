"""Fully sharded data parallelism (ZeRO stage 3) from scratch (chapter 9).

ZeRO stages 1 and 2 (:mod:`dpcourse.sharding.zero`) shard the optimizer state and the gradients,
but every rank still holds every parameter. Stage 3 shards the parameters too, as torch's FSDP2
(``fully_shard``) does, and :class:`FSDP` follows its design:

1. **shard**: each parameter of a sharded layer is cut along dim 0 into N shards; between uses
   the module holds only this rank's rows, as fp32 master weights
   (:mod:`dpcourse.sharding.fsdp_layer`), and an optimizer built on ``fsdp.parameters()`` keeps 1/N
   of every state: ZeRO-3 is FSDP
   plus any torch optimizer;
2. **gather, compute, free**: a layer's forward pre-hook all-gathers its parameters (cast to
   ``compute_dtype`` first, so the traffic is in that dtype), its forward hook frees them;
3. **backward**: the gradient of a layer's output arrives just before the layer's backward, and
   a hook on it gathers the layer again; once every trainable parameter of the layer has its
   gradient, they are reduce-scattered (in fp32 unless chapter 11's policy says otherwise),
   averaged, added to the shards' ``.grad``, and the full parameters are freed (ZeRO-3's
   order: gather, compute, free; reduce-scatter, free);
4. **prefetch**: every collective runs on one communication thread, in the order the hooks
   submit them (the same on every rank); on a GPU, on the thread's own streams, an all-gather
   stream and a reduce-scatter stream, synchronised with the compute stream by events
   (:class:`~dpcourse.sharding.fsdp_layer.CommThread`). With ``prefetch=True`` a layer's pre-hook
   also submits the next layer's all-gather (the previous layer's, in backward), so it is on the
   wire while this layer computes: at most two layers are gathered at a time.

Parameters outside the sharded layers stay replicated; their gradients are all-reduced in
:meth:`FSDP.finish_gradient_synchronization`, which also all-reduces a few flags in one message:
whether any rank's reduced gradients were not finite, and which parameters got a gradient on
some rank. A parameter that no rank used keeps the gradient it had (``None`` after
``zero_grad()``), so that the optimizer skips it, as with torch's DDP and FSDP (zeros would move
it under momentum, Adam or weight decay). Each rank's reduce-scatter brings it only its own rows,
so an overflow reaches only the ranks that own the rows it hit, and in fp16 a sum can overflow
where no rank's own gradient did; each rank therefore checks the rows it received, after the
sum, and with the all-reduced flag every rank's gradients are made non-finite, so that a
``GradScaler`` skips the step on every rank, as with DDP's all-reduce. A step is
``loss.backward(); fsdp.finish_gradient_synchronization(); optimizer.step()``.

The gradients it leaves are this rank's rows, marked (:mod:`dpcourse.sharding.shard_grads`):
torch's ``clip_grad_norm_`` would take this rank's part of the norm for the whole, and refuses
them; :meth:`FSDP.clip_grad_norm_` clips by the global norm. A ``GradScaler`` reads the
all-reduced flag from them, even on a rank that holds no rows.

Chapter 11 gives it the knobs of ``fully_shard``: a mixed-precision policy (``mp_policy``, with
torch's ``MixedPrecisionPolicy`` or anything with its four fields: the dtype of the gathered
parameters, of the gradient reduction, of the output); ``reshard_after_forward=False``, which
keeps each layer's gathered parameters from its forward to its backward (one all-gather per
layer and step instead of two, for the memory of every layer gathered at once, ZeRO-2's);
gradient accumulation without synchronising (:meth:`FSDP.set_requires_gradient_sync`,
:meth:`FSDP.no_sync`: the full gradients are kept, no reduce-scatter per micro-batch); a layer's
forward run again in backward by activation checkpointing, which reuses the gathered parameters
instead of gathering them a second time (:meth:`FSDP.in_backward`); and sharding over a
sub-group of ranks, replicated across such groups (``shard_group``, ``replicate_group``: hybrid
sharding, :mod:`dpcourse.sharding.hsdp`). A model built on the ``meta`` device is sharded without
memory, and :meth:`FSDP.materialize` then makes each rank's rows only
(:mod:`dpcourse.sharding.meta_init`).

Chapter 9: ZeRO stage 3 / FSDP from scratch.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.collectives.p2p import rank_and_size
from dpcourse.collectives.ring import ring_all_reduce
from dpcourse.collectives.tree import tree_broadcast
from dpcourse.one_device.memory import tensors_in
from dpcourse.sharding import shard_grads
from dpcourse.sharding.fsdp_layer import CommThread, CommWork, ShardedLayer

__all__ = ["FSDP"]

COMPUTE_DTYPES = (None, torch.float32, torch.float16, torch.bfloat16)


class FSDP(nn.Module):
    """``FSDP(model, layers=None, compute_dtype=None, prefetch=True)``, on every rank.

    ``layers``: names of the submodules to shard, each a unit that is gathered whole (by
    default every direct child that has parameters); parameters outside them stay replicated.
    Every rank must run the same graph, and the layers run in the same order in every forward
    (the first forward records it). ``compute_dtype`` (``torch.float16`` or ``bfloat16``): the
    sharded layers compute in it, on inputs cast to it; the masters and the gradient reduction
    stay fp32. ``fsdp.module.named_parameters()`` are the shards and the replicated parameters.

    Chapter 11's knobs (keyword arguments):

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

    The shards may live on another device than the layers compute on (chapter 11's CPU offload,
    :class:`dpcourse.sharding.fsdp_offload.OffloadedFSDP`): the all-gather copies them in, the
    reduce-scatter's rows go back to where they are.
    """

    def __init__(self, module: nn.Module, *, layers: Iterable[str] | None = None,
                 compute_dtype: torch.dtype | None = None, prefetch: bool = True,
                 mp_policy: Any = None, reshard_after_forward: bool = True,
                 shard_group: Any = None, replicate_group: Any = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FSDP wraps a torch.nn.Module (the model, on this rank's device), "
                            f"got {type(module).__name__}: FSDP(model), not "
                            "FSDP(model.parameters()) or FSDP(optimizer)")
        self.rank, self.world_size = rank_and_size()  # a clear error without a process group
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype}")
        param_dtype, reduce_dtype, output_dtype, cast_inputs = _precision(compute_dtype, mp_policy)
        if not isinstance(reshard_after_forward, bool):
            raise TypeError("reshard_after_forward must be True or False (fully_shard's int, a "
                            f"smaller group to reshard to, is not supported), got "
                            f"{reshard_after_forward!r}")
        shard_rank, shard_size, replicas = self._layout(shard_group, replicate_group)
        devices = sorted({str(t.device) for t in [*module.parameters(), *module.buffers()]})
        if len(devices) > 1:
            raise ValueError(f"the module is on several devices ({', '.join(devices)}): FSDP "
                             "shards a module on one device; move it with .to(device) first")
        children = {n: c for n, c in module.named_children() if any(True for _ in c.parameters())}
        names = list(children) if layers is None else list(layers)
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
        self.device = torch.device(devices[0] if devices else "cpu")
        for t in [*module.parameters(), *module.buffers()]:  # the replicas start equal
            if self.world_size > 1 and not self.device.type == "meta":  # meta: no values yet
                tree_broadcast(t.data, src=0)
        self.module = module
        self.prefetch = prefetch
        self.compute_dtype = param_dtype  # chapter 9's name for it
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.output_dtype, self.cast_forward_inputs = output_dtype, cast_inputs
        self.reshard_after_forward = reshard_after_forward
        self.shard_group, self.replicate_group = shard_group, replicate_group
        self.shard_rank, self.shard_size = shard_rank, shard_size
        sharded = {id(p) for n in names for p in modules[n].parameters()}
        self.replicated = [p for p in module.parameters() if id(p) not in sharded]
        owners = {m for m in module.modules()  # of replicated parameters: they compute in fp32
                  if any(id(p) not in sharded for p in m.parameters(recurse=False))}
        self.layers = [ShardedLayer.shard(n, modules[n], shard_rank, shard_size, param_dtype,
                                          reduce_dtype=reduce_dtype, group=shard_group,
                                          replicate_group=replicate_group, replicas=replicas)
                       for n in names]
        self.comm = CommThread(self.device)
        self._order: list[ShardedLayer] = []  # forward order, recorded by the first forward
        self._recorded = False
        self._pending: list[CommWork] = []  # reduce-scatters submitted in this backward
        # this backward, per trainable shard or replicated parameter: whether it got a gradient
        # on this rank, and the .grad it had before (kept if no rank used it)
        self._seen: dict[nn.Parameter, tuple[bool, torch.Tensor | None]] = {}
        self._needs_sync = False
        self._sync = True  # reduce-scatter in this backward (set_requires_gradient_sync)
        self.calls: Counter[str] = Counter()  # all-gathers and reduce-scatters submitted
        self._backward = False  # this forward's backward has begun (in_backward)
        # this rank's reduced rows not all finite (an fp16 overflow), set by the reduce-scatters
        # and all-reduced with the flags: on the device, no host sync
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        for layer in self.layers:
            layer.module.register_forward_pre_hook(self._pre_forward(layer))
            layer.module.register_forward_hook(self._post_forward(layer))
            for i in layer.trainable():
                layer.full[i].register_post_accumulate_grad_hook(self._grad_arrived(layer))
        if param_dtype is not None:
            for m in owners:
                m.register_forward_pre_hook(_cast_inputs(torch.float32))

    def _layout(self, shard_group: Any, replicate_group: Any) -> tuple[int, int, int]:
        """(this rank in its shard group, the shard group's size, the replicate group's size),
        checked: the groups must hold this rank and multiply to the world size."""
        if shard_group is None:
            if replicate_group is not None:
                raise ValueError("replicate_group needs a shard_group: the ranks of a shard "
                                 "group shard each layer, the replicate group sums across them")
            return self.rank, self.world_size, 1
        shard_rank = dist.get_rank(shard_group)
        replicate_rank = 0 if replicate_group is None else dist.get_rank(replicate_group)
        if shard_rank < 0 or replicate_rank < 0:
            raise ValueError(f"rank {self.rank} is not in the shard_group or replicate_group it "
                             "was given: pass the groups this rank belongs to")
        replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        if dist.get_world_size(shard_group) * replicas != self.world_size:
            raise ValueError(
                f"a shard group of {dist.get_world_size(shard_group)} ranks times a replicate "
                f"group of {replicas} is not the world's {self.world_size} ranks: every rank "
                "must hold one shard of one replica (HSDP's nodes x ranks per node)")
        return shard_rank, dist.get_world_size(shard_group), replicas

    # --------------------------------------------------------------------------- hooks
    def _gather(self, layer: ShardedLayer) -> None:
        if layer.gather is None and not layer.full_bytes():
            self.calls["all-gather"] += 1
            layer.gather = self.comm.submit(layer.all_gather, layer.gather_buffer())

    def _unshard(self, layer: ShardedLayer) -> None:
        self._gather(layer)  # nothing if it is gathered, or on its way (a prefetch)
        if layer.gather is not None:
            layer.copy_out(layer.gather.wait())  # the parameters are here (a GPU: will be)
            layer.gather = None  # its buffer goes, after the compute stream waited for it

    def _neighbour(self, layer: ShardedLayer, step: int) -> ShardedLayer | None:
        if not self._recorded or layer not in self._order:
            return None
        i = self._order.index(layer) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def in_backward(self) -> bool:
        """Whether the backward of the last forward has begun (the gradient of the wrapped
        model's output has arrived) and not yet been synchronised. A layer's forward that runs
        then is a recomputation (activation checkpointing): it uses the parameters that backward
        gathers, or gathers them for backward, and does not free them."""
        return self._backward

    def _pre_forward(self, layer: ShardedLayer):
        def hook(module: nn.Module, args: tuple) -> tuple:
            recomputing = self.in_backward()
            if not self._recorded and not recomputing:
                self._order.append(layer)
            self._unshard(layer)  # a recomputation finds the layer gathered for its backward
            if (self.prefetch and not recomputing
                    and (nxt := self._neighbour(layer, +1)) is not None):
                self._gather(nxt)  # on the wire while this layer computes
            layer.use_full(True)
            if self.param_dtype is None or not self.cast_forward_inputs:
                return args
            return _cast(args, self.param_dtype)
        return hook

    def _post_forward(self, layer: ShardedLayer):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            layer.use_full(False)
            if self.in_backward():  # a recomputation: backward uses these parameters next
                return
            if self.reshard_after_forward:
                layer.free()
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self._pre_backward(layer))
        return hook

    def _pre_backward(self, layer: ShardedLayer) -> None:
        if layer.reduced:
            return
        self._unshard(layer)
        # in the module too: a recomputation that runs the layer's inner modules (activation
        # checkpointing inside the sharded unit) uses the module's parameters, not autograd's
        layer.use_full(True)
        if self.prefetch and (prev := self._neighbour(layer, -1)) is not None:
            if not prev.reduced:
                self._gather(prev)

    def _grad_arrived(self, layer: ShardedLayer):
        def hook(param: torch.Tensor) -> None:
            layer.arrived += 1
            if layer.arrived == len(layer.trainable()):
                if self._sync:
                    self._reduce(layer)
                else:  # accumulating: keep the full gradients, send nothing
                    layer.accumulate()
                if len(layer.trainable()) == len(layer.full):  # no frozen weight still needed
                    layer.use_full(False)
                    layer.free()
        return hook

    def _reduce(self, layer: ShardedLayer) -> None:
        layer.reduced = True
        self.calls["reduce-scatter"] += 1
        if self._pending:  # as FSDP2: the last reduce-scatter's input goes, once waited for
            self._pending[-1].release()
        for i in layer.trainable():
            self._seen[layer.shards[i]] = (layer.has_grad(i), layer.shards[i].grad)
        flat = layer.pack_grads()
        self._pending.append(self.comm.submit(layer.reduce_scatter, flat, self._nonfinite,
                                              stream="reduce-scatter"))

    # ------------------------------------------------------------------------- the step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._needs_sync:
            raise RuntimeError(
                "forward was called again before the previous backward's gradients were "
                "synchronised: call fsdp.finish_gradient_synchronization() after backward and "
                "before optimizer.step() (or, to accumulate gradients over micro-batches "
                "without synchronising, run their forward and backward in `with fsdp.no_sync():`)"
            )
        self._backward = False
        for layer in self.layers:
            layer.arrived, layer.reduced = 0, False
            if layer.gather is not None or layer.full_bytes():  # kept from a forward whose
                layer.free()  # backward never ran (evaluation, reshard_after_forward=False)
        out = self.module(*args, **kwargs)
        self._recorded = True
        if self.output_dtype is not None:
            out = _cast_outputs(out, self.output_dtype)
        grads = [t for t in tensors_in(out) if t.requires_grad]
        self._needs_sync = bool(grads) and self._sync
        for t in grads:  # backward starts here: the first gradient to arrive is the output's
            t.register_hook(self._backward_begins)
        return out

    def _backward_begins(self, grad: torch.Tensor) -> None:
        self._backward = True

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """Whether the backward passes that follow reduce-scatter the gradients (True, the
        default) or keep each layer's full gradients on this rank, added up over the
        micro-batches, in the reduce dtype (False): no communication, the memory of unsharded
        gradients. The backward after turning it on again reduces the sum. As ``fully_shard``'s
        method of the same name."""
        if not isinstance(requires, bool):
            raise TypeError(f"requires must be True or False, got {requires!r}")
        self._sync = requires

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, backward accumulates full gradients without synchronising them
        (as DDP's ``no_sync``): run the last micro-batch outside it."""
        before = self._sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(before)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter; reduce-scatter the layers whose gradients did not all
        arrive (a missing gradient counts as zero) and all-reduce the replicated parameters'
        gradients (averaged). Afterwards every shard's ``.grad`` is its rows of the average (a
        :class:`~dpcourse.sharding.shard_grads.ShardGrad`); if any rank's reduced gradients were
        not finite, every rank's are (a NaN in each), so that a ``GradScaler`` skips the step on
        every rank; a parameter that no rank used has the gradient it had before this backward
        (``None`` after ``zero_grad``)."""
        self._backward = False
        for layer in self.layers:
            if not layer.reduced and layer.trainable():
                self._reduce(layer)
        for work in self._pending:  # the reduce-scatters: this rank's rows, and their flag
            work.wait()
        self._pending.clear()
        self._seen.update((p, (p.grad is not None, p.grad)) for p in self.replicated
                          if p.requires_grad)
        # in one order on every rank: the layers', then the replicated parameters'
        used = [self._seen[p][0] for p in self._trainable()]
        pending = []
        replicated = [p for p in self.replicated if p.requires_grad]
        if replicated and self.world_size > 1:  # their gradients, averaged in one flat ring
            flat = _flat_grads(replicated)
            pending.append(self.comm.submit(ring_all_reduce, flat, "mean", False,
                                            stream="reduce-scatter"))
        # one message: whether this rank's reduced rows overflowed (1: not finite) and, per
        # parameter, whether it got a gradient here
        flags = torch.ones(1 + len(used), dtype=torch.uint8, device=self.device)
        flags[0] = self._nonfinite
        if not all(used):
            flags[1:] = torch.tensor(used, dtype=torch.uint8).to(flags.device)  # rare: a copy
        if self.world_size > 1:
            pending.append(self.comm.submit(ring_all_reduce, flags, "max", False,
                                            stream="reduce-scatter"))
        for work in pending:
            work.wait()
        if replicated and self.world_size > 1:
            _set_grads(replicated, flat)
        self._nonfinite.zero_()
        for layer in self.layers:
            layer.use_full(False)
            layer.free()
        self._keep_unused(flags, all(used))
        grads = [p.grad for p in self.parameters() if p.grad is not None and p.grad.numel()]
        overflow = flags[0].bool()
        for g in grads:  # a tensor op, not `if overflow:`, which would wait for the GPU
            # (offloaded shards' gradients are on the host: the flag is copied there)
            g.view(-1)[:1].masked_fill_(overflow.to(g.device), float("nan"))
        # torch's clip_grad_norm_ refuses them, and a GradScaler reads the flag (even where this
        # rank holds no rows)
        shard_grads.mark_shards(self._shards(), overflow)
        self._needs_sync = False

    def _shards(self) -> list[nn.Parameter]:
        return [shard for layer in self.layers for shard in layer.shards]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that the whole model's gradient has a ``norm_type``-norm of
        at most ``max_norm``, and return that norm (a 0-dim tensor, the same on every rank), as
        ``torch.nn.utils.clip_grad_norm_`` does on unsharded gradients (on our shards it would
        take each rank's own part, and refuses: :mod:`dpcourse.sharding.shard_grads`). Call it
        on every rank, after :meth:`finish_gradient_synchronization` (and after
        ``scaler.unscale_(optimizer)`` where a GradScaler scales the loss), before the step."""
        if self._needs_sync:
            raise RuntimeError("clip_grad_norm_ before finish_gradient_synchronization: the "
                               "gradients are not yet averaged; call "
                               "fsdp.finish_gradient_synchronization() first")
        sharded = [s.grad for s in self._shards() if s.grad is not None]
        whole = [p.grad for p in self.replicated if p.grad is not None]
        norm = torch.zeros((), device=self.device)  # made here, on the caller's stream
        work = self.comm.submit(shard_grads.clip_grad_norm_, sharded, whole, max_norm,
                                float(norm_type), self.shard_rank, self.shard_size,
                                self.shard_group, norm, stream="reduce-scatter")
        return work.wait()

    def _trainable(self) -> list[nn.Parameter]:
        return ([layer.shards[i] for layer in self.layers for i in layer.trainable()]
                + [p for p in self.replicated if p.requires_grad])

    def _keep_unused(self, flags: torch.Tensor, all_used_here: bool) -> None:
        """Give the parameters that no rank used (``flags[1:]``, all-reduced) the gradient they
        had before this backward. If every one got a gradient here, nothing is read: the flags
        stay on the device (torch's DDP reads its map of used parameters only in the other
        case too)."""
        if not all_used_here:
            for p, used in zip(self._trainable(), flags[1:].tolist(), strict=True):
                if not used:
                    p.grad = self._seen[p][1]
        self._seen.clear()

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
        optimizer afterwards: the parameters are new tensors."""
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
                if full.requires_grad:
                    layer.full[i].register_post_accumulate_grad_hook(self._grad_arrived(layer))
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
        self.comm = CommThread(device)
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=device)

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

    def unsharded_grad_bytes(self) -> int:
        """Bytes of full gradients this rank holds now: those of a layer whose backward ran and
        whose gradients are not yet reduced, and those accumulated without synchronising."""
        return sum(sum(f.grad.numel() * f.grad.element_size() for f in layer.full
                       if f.grad is not None) + layer.accumulated_bytes()
                   for layer in self.layers)

    def close(self) -> None:
        """Stop the communication thread (it also stops with the process)."""
        self.comm.close()


# ------------------------------------------------------------------------------- helpers
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


def _cast(args: tuple, dtype: torch.dtype) -> tuple:
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


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


def _cast_outputs(out: Any, dtype: torch.dtype) -> Any:
    """``out`` with its floating-point tensors cast to ``dtype`` (tuples, lists, dicts kept)."""
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.is_floating_point() else out
    if isinstance(out, (tuple, list)):
        return type(out)(_cast_outputs(o, dtype) for o in out)
    if isinstance(out, dict):
        return {k: _cast_outputs(v, dtype) for k, v in out.items()}
    return out


def _precision(compute_dtype: torch.dtype | None, mp_policy: Any
               ) -> tuple[torch.dtype | None, torch.dtype, torch.dtype | None, bool]:
    """(gathered parameters' dtype, reduction dtype, output dtype, cast inputs) from chapter 9's
    ``compute_dtype`` (reduction in fp32) or a ``MixedPrecisionPolicy`` (read as
    ``fully_shard`` reads it: the reduction in ``param_dtype`` unless ``reduce_dtype`` says)."""
    if mp_policy is None:
        return compute_dtype, torch.float32, None, True
    if compute_dtype is not None:
        raise ValueError("pass compute_dtype or mp_policy, not both: mp_policy.param_dtype is "
                         "the compute dtype")
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    missing = [f for f in fields if not hasattr(mp_policy, f)]
    if missing:
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (from "
                        f"torch.distributed.fsdp) or have its fields; missing {missing}")
    param, reduce = mp_policy.param_dtype, mp_policy.reduce_dtype
    for name, dtype in (("param_dtype", param), ("reduce_dtype", reduce)):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"mp_policy.{name} must be one of {COMPUTE_DTYPES}, got {dtype}")
    reduce = reduce or param or torch.float32
    return param, reduce, mp_policy.output_dtype, bool(mp_policy.cast_forward_inputs)


def _cast_inputs(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return _cast(args, dtype)
    return hook


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
