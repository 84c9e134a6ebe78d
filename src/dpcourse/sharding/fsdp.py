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
   gradient, they are reduce-scattered in fp32, averaged, added to the shards' ``.grad``, and
   the full parameters are freed (ZeRO-3's order: gather, compute, free; reduce-scatter, free);
4. **prefetch**: every collective runs on one communication thread, in the order the hooks
   submit them (the same on every rank); on a GPU, on the thread's own streams, an all-gather
   stream and a reduce-scatter stream, synchronised with the compute stream by events
   (:class:`~dpcourse.sharding.fsdp_layer.CommThread`). With ``prefetch=True`` a layer's pre-hook
   also submits the next layer's all-gather (the previous layer's, in backward), so it is on the
   wire while this layer computes: at most two layers are gathered at a time.

Parameters outside the sharded layers stay replicated; their gradients are all-reduced in
:meth:`FSDP.finish_gradient_synchronization`, which also all-reduces a few flags in one message:
whether any rank's gradients were not finite, and which parameters got a gradient on some rank.
A parameter that no rank used keeps the gradient it had (``None`` after ``zero_grad()``), so
that the optimizer skips it, as with torch's DDP and FSDP (zeros would move it under momentum,
Adam or weight decay). Each rank's reduce-scatter brings it only its own rows, so an fp16
overflow on one rank would reach only the owners of the rows it hit, and a ``GradScaler`` on the
other ranks would step while theirs skip (and their scales part ways); with the flag, every
rank's gradients are made non-finite and every rank skips the step, as with DDP's all-reduce
(torch's ``ShardedGradScaler`` all-reduces its flag for the same reason). A step is
``loss.backward(); fsdp.finish_gradient_synchronization(); optimizer.step()``.

Chapter 9: ZeRO stage 3 / FSDP from scratch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dpcourse.collectives.p2p import rank_and_size
from dpcourse.collectives.ring import ring_all_reduce
from dpcourse.collectives.tree import tree_broadcast
from dpcourse.one_device.memory import tensors_in
from dpcourse.sharding.fsdp_layer import CommThread, CommWork, ShardedLayer, used_here

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
    """

    def __init__(self, module: nn.Module, *, layers: Iterable[str] | None = None,
                 compute_dtype: torch.dtype | None = None, prefetch: bool = True) -> None:
        super().__init__()
        self.rank, self.world_size = rank_and_size()  # a clear error without a process group
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {compute_dtype}")
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
        for t in [*module.parameters(), *module.buffers()]:  # the replicas start equal
            if self.world_size > 1:
                tree_broadcast(t.data, src=0)
        self.module = module
        self.prefetch = prefetch
        self.compute_dtype = compute_dtype
        sharded = {id(p) for n in names for p in modules[n].parameters()}
        self.replicated = [p for p in module.parameters() if id(p) not in sharded]
        owners = {m for m in module.modules()  # of replicated parameters: they compute in fp32
                  if any(id(p) not in sharded for p in m.parameters(recurse=False))}
        self.layers = [ShardedLayer.shard(n, modules[n], self.rank, self.world_size,
                                          compute_dtype) for n in names]
        self.device = torch.device(devices[0] if devices else "cpu")
        self.comm = CommThread(self.device)
        self._order: list[ShardedLayer] = []  # forward order, recorded by the first forward
        self._recorded = False
        self._pending: list[CommWork] = []  # reduce-scatters submitted in this backward
        # this backward, per trainable shard or replicated parameter: whether it got a gradient
        # on this rank, and the .grad it had before (kept if no rank used it)
        self._seen: dict[nn.Parameter, tuple[bool, torch.Tensor | None]] = {}
        self._needs_sync = False
        # any rank's gradients not finite (an fp16 overflow): on the device, no host sync
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        for layer in self.layers:
            layer.module.register_forward_pre_hook(self._pre_forward(layer))
            layer.module.register_forward_hook(self._post_forward(layer))
            for i in layer.trainable():
                layer.full[i].register_post_accumulate_grad_hook(self._grad_arrived(layer))
        if compute_dtype is not None:
            for m in owners:
                m.register_forward_pre_hook(_cast_inputs(torch.float32))

    # --------------------------------------------------------------------------- hooks
    def _gather(self, layer: ShardedLayer) -> None:
        if layer.gather is None:
            layer.gather = self.comm.submit(layer.all_gather)

    def _neighbour(self, layer: ShardedLayer, step: int) -> ShardedLayer | None:
        if not self._recorded or layer not in self._order:
            return None
        i = self._order.index(layer) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def _pre_forward(self, layer: ShardedLayer):
        def hook(module: nn.Module, args: tuple) -> tuple:
            if not self._recorded:
                self._order.append(layer)
            self._gather(layer)
            layer.gather.wait()  # this layer's parameters are here (on a GPU: will be)
            if self.prefetch and (nxt := self._neighbour(layer, +1)) is not None:
                self._gather(nxt)  # on the wire while this layer computes
            layer.use_full(True)
            return _cast(args, self.compute_dtype) if self.compute_dtype else args
        return hook

    def _post_forward(self, layer: ShardedLayer):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            layer.use_full(False)
            layer.free()
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(lambda grad: self._pre_backward(layer))
        return hook

    def _pre_backward(self, layer: ShardedLayer) -> None:
        if layer.reduced:
            return
        self._gather(layer)
        layer.gather.wait()
        if self.prefetch and (prev := self._neighbour(layer, -1)) is not None:
            if not prev.reduced:
                self._gather(prev)

    def _grad_arrived(self, layer: ShardedLayer):
        def hook(param: torch.Tensor) -> None:
            layer.arrived += 1
            if layer.arrived == len(layer.trainable()):
                self._reduce(layer)
                if len(layer.trainable()) == len(layer.full):  # no frozen weight still needed
                    layer.free()
        return hook

    def _reduce(self, layer: ShardedLayer) -> None:
        layer.reduced = True
        for i in layer.trainable():
            self._seen[layer.shards[i]] = (layer.full[i].grad is not None, layer.shards[i].grad)
        flat = layer.pack_grads()
        self._nonfinite |= ~torch.isfinite(flat).all()
        self._pending.append(self.comm.submit(layer.reduce_scatter, flat,
                                              stream="reduce-scatter"))

    # ------------------------------------------------------------------------- the step
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._needs_sync:
            raise RuntimeError(
                "forward was called again before the previous backward's gradients were "
                "synchronised: call fsdp.finish_gradient_synchronization() after backward and "
                "before optimizer.step()"
            )
        for layer in self.layers:
            layer.arrived, layer.reduced = 0, False
        out = self.module(*args, **kwargs)
        self._recorded = True
        self._needs_sync = any(t.requires_grad for t in tensors_in(out))
        return out

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every reduce-scatter; reduce-scatter the layers whose gradients did not all
        arrive (a missing gradient counts as zero) and all-reduce the replicated parameters'
        gradients (averaged). Afterwards every shard's ``.grad`` is its rows of the average; if
        any rank's gradients were not finite, every rank's are (a NaN in each), so that a
        ``GradScaler`` skips the step on every rank; a parameter that no rank used has the
        gradient it had before this backward (``None`` after ``zero_grad``)."""
        for layer in self.layers:
            if not layer.reduced and layer.trainable():
                self._reduce(layer)
        self._seen.update((p, (p.grad is not None, p.grad)) for p in self.replicated
                          if p.requires_grad)
        # in one order on every rank: the layers', then the replicated parameters'
        used = [self._seen[p][0] for p in self._trainable()]
        if self.replicated:
            self._pending.append(self.comm.submit(_all_reduce_grads, self.replicated,
                                                  self.world_size, stream="reduce-scatter"))
        # one message: this rank's overflow (1: not finite) and, per parameter, "used here"
        flags = torch.ones(1 + len(used), dtype=torch.uint8, device=self.device)
        flags[0] = self._nonfinite
        if not all(used):
            flags[1:] = torch.tensor(used, dtype=torch.uint8).to(flags.device)  # rare: a copy
        if self.world_size > 1:
            self._pending.append(self.comm.submit(ring_all_reduce, flags, "max", False,
                                                  stream="reduce-scatter"))
        for work in self._pending:
            work.wait()
        self._pending.clear()
        self._nonfinite.zero_()
        for layer in self.layers:
            if layer.gather is not None:
                layer.gather.wait()
            layer.free()
        self._keep_unused(flags, all(used))
        grads = [p.grad for p in self.parameters() if p.grad is not None and p.grad.numel()]
        # they were made on the reduce-scatter stream; the optimizer uses them here
        used_here(grads)
        overflow = flags[0].bool()
        for g in grads:  # a tensor op, not `if overflow:`, which would wait for the GPU
            g.view(-1)[:1].masked_fill_(overflow, float("nan"))
        self._needs_sync = False

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
            self.comm.submit(layer.all_gather, whole).wait()
            for name, tensor in zip(layer.param_names, whole, strict=True):
                state[f"{layer.name}.{name}"] = tensor
        return state

    def gathered_bytes(self) -> int:
        """Bytes of full parameters this rank holds now, or is gathering (a prefetch in flight
        counts: its memory is being filled)."""
        return sum(sum(f.numel() * f.element_size() for f in layer.full)
                   for layer in self.layers if layer.gather is not None or layer.full_bytes())

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


def _cast_inputs(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return _cast(args, dtype)
    return hook


def _all_reduce_grads(params: list[nn.Parameter], world_size: int) -> None:
    """Average the replicated parameters' gradients over the ranks, in one flat ring
    all-reduce (a missing gradient counts as zero)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable or world_size == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                      for p in trainable])
    ring_all_reduce(flat, "mean", check_shapes=False)
    offset = 0
    for p in trainable:
        p.grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype).clone()
        offset += p.numel()
