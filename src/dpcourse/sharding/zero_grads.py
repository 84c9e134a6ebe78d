"""Which parameters have a gradient, as torch's optimizers see it, under ZeRO (chapter 9).

A torch optimizer skips a parameter whose ``.grad`` is ``None``: its weights and its state stay
as they are (a frozen branch, an expert of a mixture that got no tokens, a parameter used only in
some steps). Under DDP with ``find_unused_parameters=True`` a parameter that no rank used keeps
``.grad is None``; one that some rank used gets the average (the others count as zeros).

:class:`~dpcourse.sharding.zero.ShardedOptimizer` steps a flat shard, where many parameters sit
side by side, so it keeps that rule by hand: :func:`exchange_used` learns, at the end of each
reduction, which parameters got a gradient on some rank (one byte per parameter, max-reduced over
the ring);
:func:`keep_unused` then makes the step leave the others' elements, weights and optimizer state,
as they were. Both cost nothing more when every parameter got a gradient on this rank (the
common case): no copy, and no wait for the device. :func:`global_norm` is the norm that
``clip_grad_norm_`` clips by, over every rank's shard.

Chapter 9: parameters without gradients, and the global norm, under ZeRO.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dpcourse.collectives.ring import ring_all_reduce
from dpcourse.collectives.tree import tree_all_reduce
from dpcourse.sharding.flat_shards import FlatGroup

__all__ = ["exchange_used", "unused_ranges", "keep_unused", "global_norm"]


def exchange_used(local: Sequence[bool], device: torch.device, world_size: int) -> list[bool]:
    """For each parameter, whether it got a gradient on **some** rank, from ``local`` (this
    rank's answer per parameter). Every rank must call it, in the same place: one ring
    all-reduce (max) of ``len(local)`` bytes. The answer is read on the host only where this rank
    lacked a gradient: if it had every one, every parameter got one somewhere, and a GPU is not
    waited for (torch's DDP reads its map of used parameters in the same case)."""
    if world_size == 1:
        return list(local)
    everywhere = all(local)
    if everywhere:
        flags = torch.ones(len(local), dtype=torch.uint8, device=device)  # no host copy
    else:
        flags = torch.tensor(list(local), dtype=torch.uint8).to(device)
    ring_all_reduce(flags, "max", check_shapes=False)
    return [True] * len(local) if everywhere else [bool(v) for v in flags.tolist()]


def unused_ranges(group: FlatGroup, has_grad: Sequence[bool]) -> list[tuple[int, int]]:
    """The (start, end) ranges, in the shard's own indices, of the parameters of ``group``
    without a gradient (``has_grad[i]`` False) that overlap this rank's shard; adjacent ranges
    merged."""
    ranges: list[tuple[int, int]] = []
    for (s, e), has in zip(group.offsets, has_grad, strict=True):
        a, b = max(s, group.start), min(e, group.end)
        if has or a >= b:
            continue
        a, b = a - group.start, b - group.start
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return ranges


def _slices(state: dict[str, Any], shard: torch.Tensor) -> dict[str, torch.Tensor]:
    # the state tensors laid out as the shard is (Adam's moments, a momentum buffer); a step
    # counter or any other value is shared by the whole shard
    return {k: v for k, v in state.items() if torch.is_tensor(v) and v.shape == shard.shape}


@contextlib.contextmanager
def keep_unused(optimizer: torch.optim.Optimizer, groups: Sequence[FlatGroup],
                has_grad: Sequence[Sequence[bool]]) -> Iterator[None]:
    """Around ``optimizer.step()``: the elements of parameters without a gradient keep their
    weights and their state (the slices of the state tensors; zeros where the step created the
    state, as a fresh state is). A group whose shard holds only such parameters is not stepped
    at all (its ``shard.grad`` is ``None`` for the step), so its step counter does not move
    either. Nothing is copied for a group whose parameters all have a gradient."""
    kept, hidden = [], []
    for g, has in zip(groups, has_grad, strict=True):
        if all(has) or g.shard.grad is None:
            continue
        ranges = unused_ranges(g, has)
        if sum(b - a for a, b in ranges) == g.shard.numel() > 0:
            hidden.append((g.shard, g.shard.grad))  # nothing in this shard has a gradient
            g.shard.grad = None
        elif ranges:
            state = _slices(optimizer.state.get(g.shard, {}), g.shard)
            kept.append((g.shard, ranges, [(g.shard[a:b].clone(),
                                            {k: v[a:b].clone() for k, v in state.items()})
                                           for a, b in ranges]))
    try:
        yield
    finally:
        for shard, grad in hidden:
            shard.grad = grad
        for shard, ranges, saved in kept:
            state = _slices(optimizer.state.get(shard, {}), shard)
            for (a, b), (weights, old) in zip(ranges, saved, strict=True):
                shard[a:b] = weights
                for k, v in state.items():
                    v[a:b] = old[k] if k in old else 0


def global_norm(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device,
                world_size: int) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of every rank's shards (``grads``: this rank's),
    as ``torch.nn.utils.clip_grad_norm_`` computes it on DDP's full gradients: one number
    all-reduced (a sum of powers, or the max for the inf-norm). Every rank must call it."""
    if norm_type == float("inf"):
        local = max((t.abs().max() for t in grads if t.numel()), default=None)
        total = torch.zeros((), device=device) if local is None else local.float()
        if world_size > 1:
            tree_all_reduce(total.reshape(1), "max")
        return total
    total = sum((t.float().norm(norm_type) ** norm_type for t in grads),
                torch.zeros((), device=device))
    if world_size > 1:
        tree_all_reduce(total.reshape(1), "sum")
    return total ** (1.0 / norm_type)
