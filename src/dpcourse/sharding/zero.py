"""Sharded optimizers from scratch: ZeRO stages 1 and 2 (chapter 9).

Plain data parallelism keeps the whole optimizer state on every rank: N identical copies of
Adam's two moments. A sharded optimizer keeps 1/N of it on each rank (Rajbhandari et al., 2020).
For each parameter group the trainable parameters are laid end to end in one flat buffer, and the
parameters become views into it (:mod:`dpcourse.sharding.flat_shards`). Rank r **owns** the
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

:class:`ShardedOptimizerCore` is those four steps and nothing else (section 9.4 shows them).
:class:`ShardedOptimizer` is what a torch training loop takes: the core, with torch's extras as
layers on top, each in the module that says why, each shown where chapter 9 teaches it: a
``GradScaler`` that skips the same steps on every rank and parameters without a gradient left
alone (:mod:`dpcourse.sharding.zero_grads`), clipping by the global norm (the same module),
``Join`` for uneven inputs (:mod:`dpcourse.sharding.zero_join`), a full or sharded state
(:mod:`dpcourse.sharding.zero_state`), and, here, torch's arguments, their checks and ``step``'s
closure.

Flat sharding splits tensors across ranks, so every rank's share is 1/N of the elements to within
one. Optimizers that look at a whole tensor at once (LAMB's or Adafactor's per-tensor norms) would
see slices instead; ``torch.distributed.optim.ZeroRedundancyOptimizer`` gives whole tensors to
ranks instead, which keeps such optimizers exact but balances the state less evenly.

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
from dpcourse.sharding.flat_shards import FlatGroup, as_param_groups, flatten_group
from dpcourse.sharding.zero_grads import ClipByGlobalNorm, SkipUnused, SpreadOverflow
from dpcourse.sharding.zero_join import JoinableOptimizer
from dpcourse.sharding.zero_state import ShardedStateDict

__all__ = ["ShardedOptimizerCore", "ShardedOptimizer"]


class ShardedOptimizerCore(torch.optim.Optimizer):
    """ZeRO stage 1 (or 2), the four steps alone: each rank keeps the optimizer state of 1/N of
    the parameters, and the gradient averaging is the optimizer's (no DDP around the model).

    ``ShardedOptimizerCore(model.parameters(), torch.optim.AdamW, lr=1e-3)`` on every rank, in
    the loop ``opt.zero_grad(); loss.backward(); opt.step()``. ``params``: parameters or
    parameter groups, as a torch optimizer takes them; the trainable ones must be on one device,
    a group's of one dtype. ``optimizer_cls``: an elementwise torch optimizer, built on this
    rank's shards. At the end of each backward :meth:`reduce_gradients` averages the gradients
    (steps 1 and 2); :meth:`step` steps the shards and shares them (3 and 4). ``stage=2`` keeps
    only the shards of the gradients between steps; ``broadcast_parameters`` starts every rank
    from rank 0's weights. :class:`ShardedOptimizer` adds what a torch loop relies on.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 optimizer_cls: type[torch.optim.Optimizer], *, stage: int = 1,
                 broadcast_parameters: bool = True, **optimizer_kwargs: Any) -> None:
        self.rank, self.world_size = rank_and_size()  # a clear error without a process group
        self.stage, self.optimizer_cls, self._broadcast = stage, optimizer_cls, broadcast_parameters
        groups = as_param_groups(params)
        self.device = next(p for g in groups for p in g["params"] if p.requires_grad).device
        self._groups: list[FlatGroup] = []  # each group's flat buffers and this rank's shard
        self._all_params: list[list[torch.Tensor]] = []  # each group's, frozen ones included
        self.optimizer: torch.optim.Optimizer | None = None  # built by the first group
        self._sync, self._queued, self._reduced = True, False, False  # no_sync; end of backward
        super().__init__(groups, optimizer_kwargs)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (a dict with ``params`` and options), as on a torch optimizer: its
        trainable parameters get a flat buffer and a shard of their own, which the inner
        optimizer steps with the group's options. Every rank must add the same group at the same
        point (the buffer is broadcast from rank 0)."""
        (group,) = as_param_groups([param_group])
        params = [p for p in group["params"] if p.requires_grad]
        flat = flatten_group(params, self.device, self.rank, self.world_size,
                             keep_full_grad=self.stage == 1, broadcast=self._broadcast)
        for p in params:  # after flatten_group's own hook, which moves stage 1's .grad
            p.register_post_accumulate_grad_hook(self._hook)
        inner = {**{k: v for k, v in group.items() if k != "params"}, "params": [flat.shard]}
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([inner], **self.defaults)
        else:
            self.optimizer.add_param_group(inner)
        self._groups.append(flat)
        self._all_params.append(group["params"])
        # One set of groups and state: what a scheduler or a GradScaler changes here is what
        # the inner optimizer steps with.
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    # ------------------------------------------------------------------ gradients, backward
    def _hook(self, param: torch.Tensor) -> None:
        if self._sync and not self._queued:  # once per backward, when the engine is done
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
        """Steps 1 and 2: average the gradients over the ranks, this rank
        keeping its shard of the average in ``shard.grad`` (added to what
        backward left since ``zero_grad``). Runs at the end of backward."""
        self._queued = False
        flat_grads = self.flat_gradients()  # 1. each group's, end to end
        for g, flat_grad in zip(self._groups, flat_grads, strict=True):
            chunks = flat_grad.tensor_split(self.world_size)  # r owns chunk r
            ring_reduce_scatter_(chunks, "sum", self.rank)  # 2. chunk r, summed
            mine = chunks[self.rank].div_(self.world_size)  # ... and averaged
            if g.shard.grad is None:  # after zero_grad: into memory kept for it
                g.shard.grad = g.shard_grad.copy_(mine)
            else:  # a second backward since zero_grad: the gradients add up
                g.shard.grad.add_(mine)
        self._reduced = True

    def flat_gradients(self) -> list[torch.Tensor]:
        """Step 1: each group's gradients end to end in one flat buffer laid out as its
        parameters are (zeros where a parameter has none); the model's ``.grad`` go, since only
        this rank's shard of the reduced buffer will mean anything."""
        return [g.take_grads() for g in self._groups]

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, **kwargs: Any) -> None:
        """Steps 3 and 4: step this rank's shard with its averaged gradient,
        then all-gather the updated shards, so that every rank has every
        parameter again. ``kwargs`` go to the inner optimizer's ``step``."""
        if not self._reduced:  # no backward reached a parameter, or no_sync's
            self.reduce_gradients()
        self.step_shards(**kwargs)  # 3. the inner optimizer, this rank's shards
        for g in self._groups:  # 4. every rank's updated shard, to every rank
            ring_all_gather_(g.flat.tensor_split(self.world_size), self.rank)
        self._reduced = False

    def step_shards(self, **kwargs: Any) -> None:
        """Step 3: the inner optimizer's step, on this rank's shards."""
        self.optimizer.step(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard every gradient, as a torch optimizer does: the model's (left on this rank by
        ``no_sync``) and the averaged ones of the shards, which backward has already made. With
        ``set_to_none`` (default) they are ``None``; with ``False`` they are zeros, and a step
        moves the parameters as torch's moves a zero gradient (momentum, decay)."""
        for g in self._groups:
            for p in [*g.params, g.shard]:
                if p.grad is not None and set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    # ------------------------------------------------------------------------ state, layout
    @property
    def shards(self) -> list[nn.Parameter]:
        """This rank's shard of each group: flat views of the parameters it updates."""
        return [g.shard for g in self._groups]

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this optimizer holds: the shards' averaged gradients,
        and at stage 1 the flat gradient buffers too (the model's ``.grad`` are views of them
        during backward)."""
        held = [g.shard_grad for g in self._groups] + [g.grad for g in self._groups
                                                       if g.grad is not None]
        return sum(t.nbytes for t in held)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{g.end - g.start}/{g.numel}" for g in self._groups)
        return (
            f"{type(self).__name__}(stage={self.stage}, {self.optimizer_cls.__name__}, rank "
            f"{self.rank} of {self.world_size}, shard elements per group: {sizes})"
        )


class ShardedOptimizer(ShardedStateDict, JoinableOptimizer, ClipByGlobalNorm, SkipUnused,
                       SpreadOverflow, ShardedOptimizerCore):
    """ZeRO stage 1 (or 2) as a torch optimizer: :class:`ShardedOptimizerCore` and its layers.

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
    optimizer skips a ``.grad`` of ``None`` (:class:`~dpcourse.sharding.zero_grads.SkipUnused`).
    ``stage=1`` keeps one flat gradient buffer per group, which the model's ``.grad`` are views of
    during backward; ``stage=2`` keeps only the shards (a full gradient exists only until it is
    reduce-scattered).

    **A torch optimizer.** Its ``param_groups`` are those of the inner optimizer that steps this
    rank's shards: an LR scheduler (``LambdaLR(opt, ...)``) and ``torch.amp.GradScaler`` drive it
    as they drive ``ZeroRedundancyOptimizer`` (a non-finite gradient on one rank makes every
    rank's scaler skip: :class:`~dpcourse.sharding.zero_grads.SpreadOverflow`). ``step(closure)``
    calls the closure first, as torch's optimizers do; other keyword arguments go to the inner
    optimizer's ``step``. Clip with :meth:`clip_grad_norm_` (the global norm over every rank's
    shard). ``state_dict()`` is this rank's shard (a sharded checkpoint); ``load_state_dict``
    takes it, every rank's (any world size), or a full state such as a plain optimizer's;
    :meth:`consolidate_state_dict` gathers the whole one, as torch's ``ZeroRedundancyOptimizer``
    does. It is ``Joinable``: under ``torch.distributed.algorithms.Join`` ranks may have different
    numbers of batches (:mod:`dpcourse.sharding.zero_join`). ``broadcast_parameters`` (default)
    copies rank 0's parameters to every rank at construction, as DDP does. The parameters become
    views into one flat buffer per group (their ``.data`` is replaced; values are kept).
    Chapter 9.
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
        groups = _checked(params, optimizer_cls, stage)
        super().__init__(groups, optimizer_cls, stage=stage,
                         broadcast_parameters=broadcast_parameters, **optimizer_kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, as on a torch optimizer (:meth:`ShardedOptimizerCore.add_param_group`),
        after checking it: no parameter of another group, one dtype, this optimizer's device."""
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
        super().add_param_group(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None,
             **kwargs: Any) -> Any:
        """The core's step, as torch's optimizers take it: ``closure``
        (zero_grad, forward, backward; returns the loss) runs first and
        its loss is returned; ``kwargs`` go to the inner step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # its backward reduces the gradients
        super().step(**kwargs)
        return loss


def _checked(params: Any, optimizer_cls: Any, stage: Any) -> list[dict[str, Any]]:
    """The arguments of :class:`ShardedOptimizer`, checked; ``params`` as parameter groups."""
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
    rank_and_size()  # a clear error without a process group
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
    return groups
