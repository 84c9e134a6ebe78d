"""Sharded optimizers from scratch: ZeRO stages 1 and 2 (chapter 9).

Plain data parallelism keeps the whole optimizer state on every rank: N identical copies of
Adam's two moments. :class:`ShardedOptimizer` keeps 1/N of it on each rank (Rajbhandari et al.,
2020). For each parameter group the trainable parameters are laid end to end in one flat buffer,
and the parameters become views into it (:mod:`dpcourse.sharding.flat_shards`). Rank r **owns** the
contiguous slice ``chunk_bounds(numel, N)[r]`` of that buffer, the very chunk that the ring
reduce-scatter of chapter 6 leaves fully reduced on rank r. One step is then

1. copy the gradients into a flat gradient buffer of the same layout;
2. **reduce-scatter** it with our ring: rank r ends with the sum of its slice, divided by N
   (gradients are averaged, as in DDP);
3. step the slice with any elementwise torch optimizer (SGD, Adam, AdamW, ...): its state is
   created for the slice only;
4. **all-gather** the updated slices in place, so that every rank holds all the parameters again.

Reduce-scatter plus all-gather move as many bytes as one ring all-reduce, so stage 1 costs no
more communication than DDP. Stage 2 also frees the full gradients after step 2 and keeps only
the rank's shard of them.

Flat sharding splits tensors across ranks, so every rank's share is 1/N of the elements to within
one. Optimizers that look at a whole tensor at once (LAMB's or Adafactor's per-tensor norms) would
see slices instead; ``torch.distributed.optim.ZeroRedundancyOptimizer`` gives whole tensors to
ranks instead, which keeps such optimizers exact but balances the state less evenly.

A training loop sees a torch optimizer: ``zero_grad`` discards the averaged gradients too,
parameters without a gradient are not stepped (:mod:`dpcourse.sharding.zero_grads`), ``step`` takes
a closure, a full (unsharded) state loads (:mod:`dpcourse.sharding.zero_state`), and ``Join``
handles
uneven inputs (:mod:`dpcourse.sharding.zero_join`).

Chapter 9: sharded optimizers (ZeRO stages 1 and 2) from scratch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from dpcourse.collectives.p2p import rank_and_size
from dpcourse.collectives.ring import ring_all_gather_, ring_reduce_scatter_
from dpcourse.sharding.flat_shards import (
    FlatGroup,
    all_finite,
    as_param_groups,
    flatten_group,
)
from dpcourse.sharding.zero_grads import exchange_used, global_norm, keep_unused
from dpcourse.sharding.zero_join import JoinableOptimizer, notify
from dpcourse.sharding.zero_state import ShardedStateDict

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(ShardedStateDict, torch.optim.Optimizer, JoinableOptimizer):
    """ZeRO stage 1 (or 2): each rank keeps the optimizer state of 1/N of the parameters.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)``
    on every rank of a process group replaces both DDP's gradient all-reduce and the optimizer,
    in a torch-style loop: ``loss.backward(); opt.step()``. ``params`` is what a torch optimizer
    takes: an iterable of parameters, or of dicts (parameter groups, each with its own options
    such as ``lr`` or ``weight_decay``). Parameters that do not require gradients are left out
    (frozen). All of a rank's trainable parameters must be on one device, and those of a group of
    one dtype; every rank must pass the same parameters in the same order. ``optimizer_cls`` is
    an elementwise torch optimizer (SGD, Adam, AdamW, ...; not LBFGS).

    **Gradients.** As DDP does, it averages the gradients by the end of each backward (the
    autograd engine runs :meth:`reduce_gradients` once backward is over): they are
    reduce-scattered, and each rank keeps the average of its own shard in ``shard.grad``; the
    model's ``.grad`` are then ``None``. Backward passes add up until ``zero_grad`` (gradient
    accumulation, as with DDP); inside :meth:`no_sync` they add up locally and are reduced by the
    next backward outside it, or by ``step``. ``zero_grad`` discards them, averaged or not. A
    parameter that got no gradient on any rank since ``zero_grad`` is not stepped, as a torch
    optimizer skips a ``.grad`` of ``None`` (:mod:`dpcourse.sharding.zero_grads`). ``stage=1``
    keeps one flat gradient buffer per group, which the model's ``.grad`` are views of during
    backward; ``stage=2`` keeps only the shards (a full gradient exists only until it is
    reduce-scattered).

    **A torch optimizer.** Its ``param_groups`` are those of the inner optimizer that steps this
    rank's shards: an LR scheduler (``LambdaLR(opt, ...)``) and ``torch.amp.GradScaler`` drive it
    as they drive ``ZeroRedundancyOptimizer``. ``step(closure)`` calls the closure first, as torch's
    optimizers do; other keyword arguments go to the inner optimizer's ``step``. Clip with
    :meth:`clip_grad_norm_` (the global norm over every rank's shard). ``state_dict()`` is this
    rank's shard (a sharded checkpoint); ``load_state_dict`` takes it, every rank's (any world
    size), or a full state such as a plain optimizer's; :meth:`consolidate_state_dict` gathers
    the whole one, as torch's ``ZeroRedundancyOptimizer`` does. It is ``Joinable``: under
    ``torch.distributed.algorithms.Join`` ranks may have different numbers of batches
    (:mod:`dpcourse.sharding.zero_join`). ``broadcast_parameters`` (default) copies rank 0's
    parameters to every rank at construction, as DDP does. The parameters become views into one
    flat buffer per group (their ``.data`` is replaced; values are kept). Chapter 9.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        stage: int = 1,
        broadcast_parameters: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(
                f"stage must be 1 (shard the optimizer state) or 2 (and the gradients), got "
                f"{stage!r}; for stage 3 use torch.distributed.fsdp.fully_shard"
            )
        is_class = isinstance(optimizer_cls, type)
        if not (is_class and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                "optimizer_cls must be a torch optimizer class such as torch.optim.AdamW (the "
                f"class, not an instance), got {optimizer_cls!r}"
            )
        if issubclass(optimizer_cls, torch.optim.LBFGS):
            raise ValueError(
                "LBFGS cannot be sharded: its line search takes dot products over all the "
                "parameters, and each rank would search its own shard and call the closure (and "
                "backward) a different number of times. Use it unsharded, or e.g. AdamW"
            )
        self.rank, self.world_size = rank_and_size()  # a clear error without a process group
        self.stage = stage
        self.optimizer_cls = optimizer_cls
        self._broadcast = broadcast_parameters
        groups = as_param_groups(params)
        trainable = [p for g in groups for p in g["params"] if p.requires_grad]
        if not trainable:
            raise ValueError(
                "ShardedOptimizer got no trainable parameters: pass model.parameters() (after "
                "moving the model to its device), and check that not every parameter is frozen"
            )
        devices = sorted({str(p.device) for p in trainable})
        if len(devices) > 1:
            raise ValueError(
                f"the parameters are on several devices ({', '.join(devices)}): a rank's "
                "parameters must all be on one device; move the model there first, e.g. "
                "model.to(dpcourse.runtime.device())"
            )
        self.device = trainable[0].device
        self._groups: list[FlatGroup] = []
        self._all_params: list[list[torch.Tensor]] = []  # each group's, frozen ones included
        self._grad_shards: list[torch.Tensor] = []  # memory of each shard.grad, kept when None
        self._has_grad: list[list[bool]] = []  # per parameter: would torch's .grad be set?
        self.optimizer: torch.optim.Optimizer | None = None  # built by the first group
        self._sync = True  # False inside no_sync()
        self._queued = False  # the end-of-backward reduction is queued
        self._reduced = False  # gradients were reduced since the last step
        self._clipped: tuple[float, float] | None = None  # clip_grad_norm_'s arguments, this step
        self.last_clip: tuple[float, float] | None = None  # ... in the last step (Join replays it)
        self._in_join_hook = False
        # torch's constructor calls add_param_group for each group: each is flattened there
        super().__init__(groups, optimizer_kwargs)
        JoinableOptimizer.__init__(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (a dict with ``params`` and options), as on a torch optimizer: its
        trainable parameters get a flat buffer and a shard of their own. Every rank must add
        the same group at the same point (the buffer is broadcast from rank 0)."""
        (group,) = as_param_groups([param_group])
        params = [p for p in group["params"] if p.requires_grad]
        known = {id(p) for ps in self._all_params for p in ps}
        if any(id(p) in known for p in group["params"]):
            raise ValueError("some parameters are already in another group of this optimizer")
        dtypes = sorted({str(p.dtype) for p in params})
        if len(dtypes) > 1:
            raise ValueError(
                f"parameter group {len(self._groups)} mixes dtypes ({', '.join(dtypes)}): one "
                "flat buffer holds one dtype; put the parameters of each dtype in a group of "
                "their own"
            )
        if any(p.device != self.device for p in params):
            raise ValueError(f"every parameter must be on {self.device}, as the first ones are")
        flat_group = flatten_group(
            params, self.device, self.rank, self.world_size,
            keep_full_grad=self.stage == 1, broadcast=self._broadcast,
        )
        for p in params:  # after flatten_group's own hook, which moves stage 1's .grad
            p.register_post_accumulate_grad_hook(self._hook)
        inner = {"params": [flat_group.shard]}
        inner.update((k, v) for k, v in group.items() if k != "params")
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([inner], **self.defaults)
        else:
            self.optimizer.add_param_group(inner)
        self._groups.append(flat_group)
        self._all_params.append(group["params"])
        self._grad_shards.append(flat_group.shard.grad)
        flat_group.shard.grad = None  # no gradient yet, as a fresh parameter has none
        self._has_grad.append([False] * len(params))
        # One set of groups and state: what a scheduler or a GradScaler changes here is what
        # the inner optimizer steps with.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    # ------------------------------------------------------------------ gradients, backward
    def _hook(self, param: torch.Tensor) -> None:
        if self._sync and not self._queued:
            Variable._execution_engine.queue_callback(self.reduce_gradients)
            self._queued = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside leave their gradients on this rank, adding up (stage 1: in
        the flat buffer); the next backward outside, or ``step``, averages the sum, as with
        DDP's ``no_sync`` (gradient accumulation without a reduce-scatter per micro-batch)."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the model's gradients over the ranks: reduce-scatter them, and add this rank's
        shard of the average to ``shard.grad`` (or write it, after ``zero_grad``); then learn
        which parameters got a gradient on some rank. Runs by itself at the end of backward;
        ``step`` runs it if no backward did."""
        self._queued = False
        notify(self)  # under torch's Join only: this rank is still training
        flat_grads, local = [], []
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for g in self._groups:
            flat_grad = g.grad if g.grad is not None else torch.empty_like(g.flat)
            for p, (s, e) in zip(g.params, g.offsets, strict=True):
                local.append(p.grad is not None)
                if p.grad is None:
                    flat_grad[s:e].zero_()
                elif p.grad.data_ptr() != flat_grad[s:e].data_ptr():  # not moved by the hook
                    flat_grad[s:e].copy_(p.grad.reshape(-1))
                # Only this rank's shard of the reduced gradient will be meaningful (stage 1's
                # buffer holds partial sums elsewhere): the model's gradients go.
                p.grad = None
            finite &= all_finite(flat_grad)
            flat_grads.append(flat_grad)
        chunks = [flat.tensor_split(self.world_size) for flat in flat_grads]
        if self.world_size > 1:
            # A non-finite gradient on this rank would reach only the owner of its element:
            # make it reach every shard, so that every rank's GradScaler skips the same step.
            # A tensor op, not `if not finite:`, which would wait for the GPU at every step.
            for cs in chunks:
                for c in cs:
                    c[:1].masked_fill_(~finite, float("nan"))
        for g, cs, memory in zip(self._groups, chunks, self._grad_shards, strict=True):
            if self.world_size > 1 and g.numel > 0:
                ring_reduce_scatter_(cs, "sum", self.rank)
            mine = cs[self.rank].div_(self.world_size)
            if g.shard.grad is None:
                g.shard.grad = memory.copy_(mine)
            else:
                g.shard.grad.add_(mine)
        # A parameter no rank used has no gradient for torch (DDP leaves its .grad None)
        used = iter(exchange_used(local, self.device, self.world_size))  # every group's, in turn
        for has in self._has_grad:
            has[:] = [u or h for h, u in zip(has, used, strict=False)]
        self._reduced = True

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Step this rank's shard with the averaged gradients, leaving parameters without one
        as they are, then all-gather the updated shards, so that every rank has every parameter
        again. ``closure`` (zero_grad, forward, backward; returns the loss) runs first, as in
        torch's optimizers, and its loss is returned; ``kwargs`` go to the inner step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # its backward reduces the gradients at its end
        if not self._reduced:  # no backward on this rank reached a parameter, or no_sync
            self.reduce_gradients()
        with keep_unused(self.optimizer, self._groups, self._has_grad):
            self.optimizer.step(**kwargs)
        for g in self._groups:
            if self.world_size > 1 and g.numel > 0:
                ring_all_gather_(g.flat.tensor_split(self.world_size), self.rank)
        self._reduced = False
        self.last_clip, self._clipped = self._clipped, None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient, as a torch optimizer does: the model's (left on this rank by
        ``no_sync``) and the averaged ones of the shards, which backward has already made. With
        ``set_to_none`` (default) they are ``None`` and the parameters have no gradient until
        the next backward gives them one (a step leaves them as they are); with ``False`` they
        are zeros, and a step moves them as torch's moves a zero gradient (momentum, decay)."""
        for g in self._groups:
            for p in [*g.params, g.shard]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        if set_to_none:
            for has in self._has_grad:
                has[:] = [False] * len(has)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their norm over all ranks' shards is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on DDP's full gradients; returns
        that global norm. Call it after backward (and after ``scaler.unscale_(opt)``)."""
        if not self._reduced:
            self.reduce_gradients()
        self._clipped = (max_norm, norm_type)
        grads = [g.shard.grad for g in self._groups if g.shard.grad is not None]
        total = global_norm(grads, float(norm_type), self.device, self.world_size)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's formula
        for t in grads:
            t.mul_(coef.to(t.dtype))
        return total

    # ------------------------------------------------------------------------ state, layout
    @property
    def shards(self) -> list[nn.Parameter]:
        """This rank's shard of each group: flat views of the parameters it updates."""
        return [g.shard for g in self._groups]

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this optimizer holds: the shards' averaged gradients,
        and at stage 1 the flat gradient buffers too (the model's ``.grad`` are views of them
        during backward)."""
        held = self._grad_shards + [g.grad for g in self._groups if g.grad is not None]
        return sum(t.nbytes for t in held)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{g.end - g.start}/{g.numel}" for g in self._groups)
        return (
            f"ShardedOptimizer(stage={self.stage}, {self.optimizer_cls.__name__}, rank "
            f"{self.rank} of {self.world_size}, shard elements per group: {sizes})"
        )
