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

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dpcourse.collectives.p2p import rank_and_size
from dpcourse.collectives.ring import ring_all_gather_, ring_reduce_scatter_
from dpcourse.flat_shards import FlatGroup, flatten_group, owner_of, shard_bounds

__all__ = [
    "ShardedOptimizer",
    "shard_bounds",
    "owner_of",
]


class ShardedOptimizer:
    """ZeRO stage 1 (or 2): each rank keeps the optimizer state of 1/N of the parameters.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)``
    on every rank of a process group replaces both DDP's gradient all-reduce and the optimizer:
    call ``loss.backward()`` then ``step()``. ``params`` is what a torch optimizer takes: an
    iterable of parameters, or of dicts (parameter groups, each with its own options such as
    ``lr`` or ``weight_decay``). Parameters that do not require gradients are left out (frozen).
    All of a rank's trainable parameters must be on one device, and those of a group of one
    dtype; every rank must pass the same parameters in the same order.

    ``stage=1`` shards the optimizer state and keeps one flat gradient buffer per group, which
    the model's ``.grad`` become views of during backward (a hook moves each gradient there as
    it is produced); ``stage=2`` keeps only this rank's shard of the gradients (the full ones
    are freed after the reduce-scatter). After ``step`` every ``p.grad`` is ``None``.
    ``broadcast_parameters`` (default) copies rank 0's parameters to every rank at
    construction, so that the replicas start equal, as DDP does.

    The parameters become views into one flat buffer per group (their ``.data`` is replaced;
    values are kept). A parameter without a gradient at ``step`` counts as a zero gradient.
    Gradients are averaged inside ``step``, so code that reads ``.grad`` between backward and
    ``step`` (gradient clipping, say) sees this rank's own gradients, not the average that DDP
    would show. For a learning-rate scheduler, pass it the inner torch optimizer,
    ``sharded.optimizer``.
    ``state_dict()`` is this rank's shard (a sharded checkpoint); load it on the same rank of
    the same world size. Chapter 9.
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
        groups = _as_groups(params)
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
        inner_groups = []
        for i, group in enumerate(groups):
            params_g = [p for p in group["params"] if p.requires_grad]
            dtypes = sorted({str(p.dtype) for p in params_g})
            if len(dtypes) > 1:
                raise ValueError(
                    f"parameter group {i} mixes dtypes ({', '.join(dtypes)}): one flat buffer "
                    "holds one dtype; put the parameters of each dtype in a group of their own"
                )
            flat_group = flatten_group(
                params_g, self.device, self.rank, self.world_size,
                keep_full_grad=self.stage == 1, broadcast=broadcast_parameters,
            )
            self._groups.append(flat_group)
            options = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({"params": [flat_group.shard], **options})
        self.optimizer = optimizer_cls(inner_groups, **optimizer_kwargs)

    # ----------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Average the gradients over the ranks (reduce-scatter), step this rank's shard,
        and all-gather the updated shards, so that every rank has every parameter again."""
        if closure is not None:
            raise ValueError(
                "ShardedOptimizer.step does not take a closure (LBFGS-style "
                "optimizers re-evaluate the whole model, which it cannot shard)"
            )
        for g in self._groups:
            if g.numel == 0:
                continue
            flat_grad = g.grad if g.grad is not None else torch.empty_like(g.flat)
            for p, (s, e) in zip(g.params, g.offsets, strict=True):
                if p.grad is None:
                    flat_grad[s:e].zero_()
                elif p.grad.data_ptr() != flat_grad[s:e].data_ptr():  # not moved by the hook
                    flat_grad[s:e].copy_(p.grad.reshape(-1))
            if self.world_size > 1:
                ring_reduce_scatter_(flat_grad.tensor_split(self.world_size), "sum", self.rank)
            if self.stage == 1:
                g.shard.grad.div_(self.world_size)  # a view of flat_grad[start:end]
            else:
                torch.div(flat_grad[g.start : g.end], self.world_size, out=g.shard.grad)
                del flat_grad
            # Only this rank's shard of the reduced gradient is meaningful now (stage 1's
            # buffer holds partial sums elsewhere): the model's gradients go.
            for p in g.params:
                p.grad = None
        self.optimizer.step()
        for g in self._groups:
            if self.world_size > 1 and g.numel > 0:
                ring_all_gather_(g.flat.tensor_split(self.world_size), self.rank)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (``None``, or zeros with ``set_to_none=False``)."""
        for g in self._groups:
            for p in g.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ------------------------------------------------------------------------ torch.optim API
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups: the options (``lr``, ...) can be read and changed here;
        ``params`` holds this rank's shard of each group."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The inner optimizer's state: for this rank's shards only."""
        return self.optimizer.state

    @property
    def shards(self) -> list[nn.Parameter]:
        """This rank's shard of each group: flat views of the parameters it updates."""
        return [g.shard for g in self._groups]

    def gradient_bytes(self) -> int:
        """Bytes of the gradient buffers this optimizer holds (the model's ``.grad`` are views
        of them during backward): the flat gradient buffers at stage 1, the shards at stage 2."""
        held = [g.grad for g in self._groups if g.grad is not None]
        if self.stage == 2:
            held = [g.shard.grad for g in self._groups]
        return sum(t.nbytes for t in held)

    def shard_ranges(self) -> list[tuple[int, int, int]]:
        """(start, end, group numel) of this rank's shard in each group's flat buffer."""
        return [(g.start, g.end, g.numel) for g in self._groups]

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a sharded checkpoint: the inner optimizer's state (its shards)
        and the layout it belongs to. Save one file per rank."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "layout": self._layout(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from this rank's :meth:`state_dict` (saved by the same rank, same world size
        and the same parameters)."""
        if "layout" not in state_dict or "optimizer" not in state_dict:
            raise ValueError(
                "not a ShardedOptimizer checkpoint (expected the keys 'optimizer' and "
                "'layout'): load what ShardedOptimizer.state_dict() returned on this rank"
            )
        saved, mine = state_dict["layout"], self._layout()
        if saved != mine:
            raise ValueError(
                f"this checkpoint belongs to rank {saved['rank']} of {saved['world_size']} "
                f"with groups of {saved['numels']} elements; this is rank {self.rank} of "
                f"{self.world_size} with groups of {mine['numels']}. Load each rank's own file "
                "on the same world size and model (resharding is not supported)"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])

    def _layout(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "stage": self.stage,
            "numels": [g.numel for g in self._groups],
            "shards": [(g.start, g.end) for g in self._groups],
        }

    def __repr__(self) -> str:
        sizes = ", ".join(f"{g.end - g.start}/{g.numel}" for g in self._groups)
        return (
            f"ShardedOptimizer(stage={self.stage}, {self.optimizer_cls.__name__}, rank "
            f"{self.rank} of {self.world_size}, shard elements per group: {sizes})"
        )


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """A torch optimizer's ``params`` argument as a list of groups (dicts with "params")."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or of dicts, not a tensor: pass "
            "model.parameters() or [tensor]"
        )
    items = list(params)
    if not items:
        raise ValueError(
            "ShardedOptimizer got an empty parameter list: pass model.parameters() (a "
            "generator can be used only once; did something consume it already?)"
        )
    if all(isinstance(item, dict) for item in items):
        groups = []
        for item in items:
            if "params" not in item:
                raise ValueError("every parameter group needs a 'params' entry")
            ps = item["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            groups.append({**item, "params": ps})
    elif any(isinstance(item, dict) for item in items):
        raise TypeError("params mixes tensors and dicts: pass either tensors or parameter groups")
    else:
        groups = [{"params": items}]
    seen: set[int] = set()
    for g in groups:
        for p in g["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"expected parameters (tensors), got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError("a parameter appears twice in params; pass each once")
            seen.add(id(p))
            if p.requires_grad and not p.is_leaf:
                raise ValueError("can only optimize leaf tensors (model parameters)")
    return groups
