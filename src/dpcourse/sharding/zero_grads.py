"""The gradients as torch's loop expects them under ZeRO: layers for a GradScaler, for parameters
without a gradient and for clipping (chapter 9).

The core, :class:`~dpcourse.sharding.zero.ShardedOptimizerCore`, averages the gradients and steps
this rank's shard (section 9.4). A torch training loop
relies on three things more, and each is a layer here, a class that overrides one step of the
core and calls it (``super()``); :class:`~dpcourse.sharding.zero.ShardedOptimizer` puts them
together:

* :class:`SpreadOverflow`: a ``GradScaler`` skips a step when a gradient overflowed. After the
  reduce-scatter, a non-finite gradient on one rank reaches only the owner of its element; this
  layer makes it reach every rank's shard, so that every rank's scaler skips the same step (a rank
  that skipped alone would hang the others in the next all-gather). Section 9.4.
* :class:`SkipUnused`: a torch optimizer skips a parameter whose ``.grad`` is ``None``, its
  weights and its state staying as they are (a frozen branch, an expert of a mixture that got no
  tokens, a parameter used only in some steps). Under DDP with ``find_unused_parameters=True`` a
  parameter that no rank used keeps ``.grad is None``; one that some rank used gets the average
  (the others count as zeros). The core steps a flat shard, where many parameters sit side by
  side, so this layer keeps that rule by hand: :func:`exchange_used` learns, at the end of each
  reduction, which parameters got a gradient on some rank (one byte per parameter, max-reduced
  over the ring); :func:`keep_unused` then makes the step leave the others' elements, weights and
  optimizer state, as they were. Both cost nothing more when every parameter got a gradient on
  this rank (the common case): no copy, and no wait for the device. Section 9.5.
* :class:`ClipByGlobalNorm`: ``clip_grad_norm_`` by the norm of the whole averaged gradient,
  every rank's shard of it (:func:`global_norm`), so that every rank scales by the same factor.
  Section 9.5.

Chapter 9: what torch's loop expects of the gradients, as layers on ZeRO's core.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dpcourse.collectives.ring import ring_all_reduce
from dpcourse.collectives.tree import tree_all_reduce
from dpcourse.sharding.flat_shards import FlatGroup, all_finite

__all__ = ["SpreadOverflow", "SkipUnused", "ClipByGlobalNorm", "exchange_used", "unused_ranges",
           "keep_unused", "global_norm"]


class SpreadOverflow:
    """The layer for ``torch.amp.GradScaler`` on the core's step 1: if a gradient on this rank is
    not finite, every rank's chunk of the flat gradients gets a NaN, so that after the
    reduce-scatter every rank's shard holds one and every rank's scaler skips the same step.
    A tensor op, not ``if not finite:``, which would wait for a GPU at every step."""

    def flat_gradients(self) -> list[torch.Tensor]:
        flat_grads = super().flat_gradients()
        if self.world_size > 1:
            finite = torch.ones((), dtype=torch.bool, device=self.device)
            for flat_grad in flat_grads:
                finite &= all_finite(flat_grad)
            for flat_grad in flat_grads:  # the first element of each chunk
                for chunk in flat_grad.tensor_split(self.world_size):
                    chunk[:1].masked_fill_(~finite, float("nan"))
        return flat_grads


class SkipUnused:
    """The layer that leaves a parameter without a gradient as a torch optimizer leaves it: one
    that got no gradient on any rank since ``zero_grad`` keeps its weights and its optimizer
    state through the step. Each reduction learns which parameters some rank used
    (:func:`exchange_used`); the step of the shards keeps the others (:func:`keep_unused`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._has_grad: list[list[bool]] = []  # per group and parameter: would .grad be set?
        super().__init__(*args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._has_grad.append([False] * len(self._groups[-1].params))

    def reduce_gradients(self) -> None:
        local = [p.grad is not None for g in self._groups for p in g.params]
        super().reduce_gradients()  # the core takes them: read them first
        used = iter(exchange_used(local, self.device, self.world_size))
        for has in self._has_grad:  # every group's flags, in turn
            has[:] = [h or u for h, u in zip(has, used, strict=False)]

    def step_shards(self, **kwargs: Any) -> None:
        with keep_unused(self.optimizer, self._groups, self._has_grad):
            super().step_shards(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if set_to_none:  # no gradient until the next backward gives one (zeros are one)
            for has in self._has_grad:
                has[:] = [False] * len(has)


class ClipByGlobalNorm:
    """The layer that clips as ``torch.nn.utils.clip_grad_norm_`` clips DDP's full gradients,
    though each rank holds only its shard of the averaged gradient."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0
                        ) -> torch.Tensor:
        """Scale the averaged gradients so that their norm over all ranks'
        shards is at most ``max_norm``, and return that global norm. Call it on
        every rank after backward (after ``scaler.unscale_(opt)``), before
        ``step``."""
        if not self._reduced:
            self.reduce_gradients()
        grads = [g.shard.grad for g in self._groups if g.shard.grad is not None]
        total = global_norm(grads, float(norm_type), self.device,
                            self.world_size)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's
        for t in grads:
            t.mul_(coef.to(t.dtype))
        return total


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

