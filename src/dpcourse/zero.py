"""Sharded optimizers from scratch: ZeRO stages 1 and 2 (chapter 9).

Plain data parallelism keeps the whole optimizer state on every rank: N identical copies of
Adam's two moments. :class:`ShardedOptimizer` keeps 1/N of it on each rank (Rajbhandari et al.,
2020). For each parameter group the trainable parameters are laid end to end in one flat buffer,
and the parameters become views into it (:mod:`dpcourse.flat_shards`). Rank r **owns** the
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

Chapter 9: sharded optimizers (ZeRO stages 1 and 2) from scratch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from dpcourse import zero_state
from dpcourse.collectives.p2p import rank_and_size
from dpcourse.collectives.ring import ring_all_gather_, ring_reduce_scatter_
from dpcourse.collectives.tree import tree_all_reduce
from dpcourse.flat_shards import FlatGroup, as_param_groups, flatten_group, owner_of, shard_bounds

__all__ = [
    "ShardedOptimizer",
    "shard_bounds",
    "owner_of",
]


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 (or 2): each rank keeps the optimizer state of 1/N of the parameters.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)``
    on every rank of a process group replaces both DDP's gradient all-reduce and the optimizer,
    in a torch-style loop: ``loss.backward(); opt.step()``. ``params`` is what a torch optimizer
    takes: an iterable of parameters, or of dicts (parameter groups, each with its own options
    such as ``lr`` or ``weight_decay``). Parameters that do not require gradients are left out
    (frozen). All of a rank's trainable parameters must be on one device, and those of a group of
    one dtype; every rank must pass the same parameters in the same order.

    **Gradients.** As DDP does, it averages the gradients by the end of each backward (the
    autograd engine runs :meth:`reduce_gradients` once backward is over): they are
    reduce-scattered, and each rank keeps the average of its own shard in ``shard.grad``; the
    model's ``.grad`` are then ``None``. Backward passes before a ``step`` add up (gradient
    accumulation, as with DDP); inside :meth:`no_sync` they add up locally and are reduced by the
    next backward outside it, or by ``step``. ``stage=1`` keeps one flat gradient buffer per
    group, which the model's ``.grad`` are views of during backward; ``stage=2`` keeps only the
    shards (a full gradient exists only until it has been reduce-scattered).

    **A torch optimizer.** It is a ``torch.optim.Optimizer`` whose ``param_groups`` are those of
    the inner optimizer that steps this rank's shards: an LR scheduler (``LambdaLR(opt, ...)``)
    and ``torch.amp.GradScaler`` drive it as they drive ``ZeroRedundancyOptimizer``. Clip with
    :meth:`clip_grad_norm_` (the global norm over every rank's shard). ``state_dict()`` is this
    rank's shard (a sharded checkpoint; load it on the same rank of the same world size);
    :meth:`consolidate_state_dict` gathers the whole one, as torch's ``ZeroRedundancyOptimizer``
    does. ``broadcast_parameters`` (default) copies rank 0's parameters to every rank at
    construction, so that the replicas start equal, as DDP does. The parameters become views
    into one flat buffer per group (their ``.data`` is replaced; values are kept). Chapter 9.
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
        self.optimizer: torch.optim.Optimizer | None = None  # built by the first group
        self._sync = True  # False inside no_sync()
        self._queued = False  # the end-of-backward reduction is queued
        self._reduced = False  # gradients were reduced since the last step
        self._fresh = True  # the next reduction overwrites the shard gradients (after a step)
        # torch's constructor calls add_param_group for each group: each is flattened there
        super().__init__(groups, optimizer_kwargs)

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
        shard of the average to ``shard.grad`` (or write it, after a step or ``zero_grad``).
        Runs by itself at the end of backward; ``step`` runs it if no backward did."""
        self._queued = False
        flat_grads = []
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for g in self._groups:
            flat_grad = g.grad if g.grad is not None else torch.empty_like(g.flat)
            for p, (s, e) in zip(g.params, g.offsets, strict=True):
                if p.grad is None:
                    flat_grad[s:e].zero_()
                elif p.grad.data_ptr() != flat_grad[s:e].data_ptr():  # not moved by the hook
                    flat_grad[s:e].copy_(p.grad.reshape(-1))
                # Only this rank's shard of the reduced gradient will be meaningful (stage 1's
                # buffer holds partial sums elsewhere): the model's gradients go.
                p.grad = None
            finite &= torch.isfinite(flat_grad).all()
            flat_grads.append(flat_grad)
        chunks = [flat.tensor_split(self.world_size) for flat in flat_grads]
        if self.world_size > 1:
            # A non-finite gradient on this rank would reach only the owner of its element:
            # make it reach every shard, so that every rank's GradScaler skips the same step.
            # A tensor op, not `if not finite:`, which would wait for the GPU at every step.
            for cs in chunks:
                for c in cs:
                    c[:1].masked_fill_(~finite, float("nan"))
        for g, cs in zip(self._groups, chunks, strict=True):
            if self.world_size > 1 and g.numel > 0:
                ring_reduce_scatter_(cs, "sum", self.rank)
            mine = cs[self.rank].div_(self.world_size)
            if g.shard.grad is None:
                g.shard.grad = mine.clone()
            elif self._fresh:
                g.shard.grad.copy_(mine)
            else:
                g.shard.grad.add_(mine)
        self._fresh, self._reduced = False, True

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Step this rank's shard with the averaged gradients, then all-gather the updated
        shards, so that every rank has every parameter again."""
        if closure is not None:
            raise ValueError(
                "ShardedOptimizer.step does not take a closure (LBFGS-style "
                "optimizers re-evaluate the whole model, which it cannot shard)"
            )
        if not self._reduced:  # no backward on this rank reached a parameter, or no_sync
            self.reduce_gradients()
        self.optimizer.step()
        for g in self._groups:
            if self.world_size > 1 and g.numel > 0:
                ring_all_gather_(g.flat.tensor_split(self.world_size), self.rank)
        self._reduced, self._fresh = False, True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (``None``, or zeros with ``set_to_none=False``); the
        next reduction writes the shards' gradients instead of adding to them."""
        for g in self._groups:
            for p in g.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self._fresh = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the averaged gradients so that their norm over all ranks' shards is at most
        ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` does on DDP's full gradients; returns
        that global norm. Call it after backward (and after ``scaler.unscale_(opt)``)."""
        if not self._reduced:
            self.reduce_gradients()
        grads = [g.shard.grad for g in self._groups if g.shard.grad is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((t.abs().max() for t in grads if t.numel()), default=None)
            total = torch.zeros((), device=self.device) if local is None else local.float()
            tree_all_reduce(total.reshape(1), "max") if self.world_size > 1 else None
        else:
            total = sum((t.float().norm(norm_type) ** norm_type for t in grads),
                        torch.zeros((), device=self.device))
            if self.world_size > 1:
                tree_all_reduce(total.reshape(1), "sum")
            total = total ** (1.0 / norm_type)
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
        held = [g.shard.grad for g in self._groups if g.shard.grad is not None]
        held += [g.grad for g in self._groups if g.grad is not None]
        return sum(t.nbytes for t in held)

    def shard_ranges(self) -> list[tuple[int, int, int]]:
        """(start, end, group numel) of this rank's shard in each group's flat buffer."""
        return [(g.start, g.end, g.numel) for g in self._groups]

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint: the inner optimizer's state (its shards)
        and the layout it belongs to. Save one file per rank."""
        return {"optimizer": self.optimizer.state_dict(), "layout": zero_state.layout(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (saved by the same rank, same world size
        and the same parameters); anything else is refused, saying why."""
        zero_state.check_sharded_checkpoint(self, state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.param_groups = self.optimizer.param_groups  # torch's load makes new groups
        self.state = self.optimizer.state

    def consolidate_state_dict(self, to: int = 0) -> dict[str, Any] | None:
        """The whole optimizer state on rank ``to`` (None on the others; every rank must call
        it): the ``state_dict`` of an unsharded ``optimizer_cls`` over the same parameters and
        groups, which a single process can load; as ``ZeroRedundancyOptimizer``'s."""
        return zero_state.consolidate(self, to)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{g.end - g.start}/{g.numel}" for g in self._groups)
        return (
            f"ShardedOptimizer(stage={self.stage}, {self.optimizer_cls.__name__}, rank "
            f"{self.rank} of {self.world_size}, shard elements per group: {sizes})"
        )

