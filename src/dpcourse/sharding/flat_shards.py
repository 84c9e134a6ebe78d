"""Flat buffers and their shards: the layout that ZeRO steps (chapter 9).

A sharded optimizer lays a parameter group's trainable parameters end to end in one flat buffer
and turns each parameter into a view of its place in it. Rank r **owns** the contiguous slice
``chunk_bounds(numel, N)[r]`` of that buffer: the very chunk that chapter 6's ring reduce-scatter
leaves fully reduced on rank r, so the reduced gradient of a shard lands where its owner needs
it, with no copy. This module holds that layout; :mod:`dpcourse.sharding.zero` steps it.

Chapter 9: the flat buffer, its shards and who owns which element.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpcourse.collectives.ops import chunk_bounds
from dpcourse.collectives.tree import tree_broadcast

__all__ = [
    "FlatGroup",
    "all_finite",
    "as_param_groups",
    "flatten_group",
    "owner_of",
    "shard_bounds",
]


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, end) of the slice of a flat buffer of ``numel`` elements that ``rank`` owns.

    The same chunks as the ring reduce-scatter (:func:`~dpcourse.collectives.ops.chunk_bounds`):
    the first ``numel % world_size`` ranks own one element more. Chapter 9's first exercise.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank} of {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return chunk_bounds(numel, world_size)[rank]


def all_finite(flat: torch.Tensor) -> torch.Tensor:
    """Whether every element of a flat gradient is finite, as a 0-dim bool tensor on its device
    (no wait for a GPU). ZeRO and FSDP (chapters 9 and 11) spread an overflow from the rank that
    saw it to every shard with it, so that every rank's GradScaler skips the same step.

    One sum instead of ``torch.isfinite(flat).all()``: an inf or a NaN anywhere makes the sum
    non-finite, and the sum reads the buffer once without a mask as large as the buffer (4.2 M
    fp32 elements on one CPU thread: 1.0 ms against 25 ms, which had made ShardedOptimizer's step
    1.22 times ZeroRedundancyOptimizer's on 2 ranks here; 0.93 with the sum). It accumulates in
    fp32 at least (fp16 gradients of a large model would overflow an fp16 sum), so it calls
    finite gradients non-finite only when their sum passes 3.4e38, a magnitude no training
    continues from. Chapter 9."""
    total = flat.sum(dtype=torch.promote_types(flat.dtype, torch.float32))
    return torch.isfinite(total)


def owner_of(index: int, numel: int, world_size: int) -> int:
    """The rank that owns element ``index`` of a flat buffer of ``numel`` elements."""
    if not 0 <= index < numel:
        raise IndexError(f"index {index} is outside a buffer of {numel} elements")
    base, extra = divmod(numel, world_size)
    # The first `extra` ranks own base + 1 elements each, the others base.
    if index < extra * (base + 1):
        return index // (base + 1)
    return extra + (index - extra * (base + 1)) // base


@dataclass
class FlatGroup:
    """One parameter group laid out flat: the buffers and where this rank's shard is."""

    params: list[nn.Parameter]
    offsets: list[tuple[int, int]]  # each parameter's (start, end) in the flat buffer
    flat: torch.Tensor  # every trainable parameter of the group, end to end
    grad: torch.Tensor | None  # flat gradient buffer (stage 1: kept; stage 2: per step)
    start: int
    end: int
    shard: nn.Parameter  # flat[start:end], the slice this rank steps
    shard_grad: torch.Tensor  # the memory of shard.grad, the shard's averaged gradient

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def take_grads(self) -> torch.Tensor:
        """The parameters' gradients end to end, laid out as :attr:`flat` is (zeros where a
        parameter has none), in the flat gradient buffer (stage 1's, where backward's hooks have
        moved them already) or a new one (stage 2); the parameters' ``.grad`` become ``None``."""
        flat_grad = self.grad if self.grad is not None else torch.empty_like(self.flat)
        for p, (s, e) in zip(self.params, self.offsets, strict=True):
            if p.grad is None:
                flat_grad[s:e].zero_()
            elif p.grad.data_ptr() != flat_grad[s:e].data_ptr():  # not moved there by a hook
                flat_grad[s:e].copy_(p.grad.reshape(-1))
            p.grad = None
        return flat_grad


def flatten_group(
    params: list[nn.Parameter],
    device: torch.device,
    rank: int,
    world_size: int,
    keep_full_grad: bool,
    broadcast: bool,
) -> FlatGroup:
    """Move ``params`` (one dtype) into one flat buffer on ``device`` and cut out ``rank``'s shard.

    Afterwards every parameter's ``.data`` is a view of the buffer, so stepping the shard (also a
    view) updates the model in place. With ``broadcast`` the buffer is first made equal to rank
    0's over the process group, so that every replica starts from the same weights. With
    ``keep_full_grad`` (stage 1) a flat gradient buffer of the same layout is allocated and each
    parameter's gradient is moved into it as backward produces it; without it (stage 2) only the
    shard's averaged gradient (``shard_grad``, which both stages keep) is held between steps. The
    shard has no ``.grad`` yet, as a fresh parameter has none.
    """
    dtype = params[0].dtype if params else torch.float32
    numel = sum(p.numel() for p in params)
    flat = torch.empty(numel, dtype=dtype, device=device)
    offsets, start = [], 0
    for p in params:
        end = start + p.numel()
        flat[start:end].copy_(p.detach().reshape(-1))
        offsets.append((start, end))
        start = end
    if broadcast and world_size > 1 and numel > 0:
        tree_broadcast(flat, src=0)
    for p, (s, e) in zip(params, offsets, strict=True):
        p.data = flat[s:e].view_as(p)  # the parameter now lives in the flat buffer
    s0, s1 = shard_bounds(numel, world_size, rank)
    shard = nn.Parameter(flat[s0:s1])  # a view: stepping it updates flat in place
    grad = torch.zeros_like(flat) if keep_full_grad else None
    if grad is not None:
        for p, (s, e) in zip(params, offsets, strict=True):
            p.register_post_accumulate_grad_hook(_into_flat(grad[s:e].view_as(p)))
    # the shard's averaged gradient gets memory of its own, kept while shard.grad is None
    return FlatGroup(params, offsets, flat, grad, s0, s1, shard, torch.zeros_like(shard))


def _into_flat(view: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook: move the parameter's fresh gradient into ``view`` (its
    place in the flat gradient buffer) and make ``.grad`` that view, so that the gradient is
    held once, as DDP's ``gradient_as_bucket_view`` does (chapter 7). Later backward passes
    then accumulate straight into the buffer."""

    def hook(param: torch.Tensor) -> None:
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    return hook


def as_param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """A torch optimizer's ``params`` argument as a list of groups (dicts with "params"),
    checked: tensors or dicts, not both; each parameter once; leaves only."""
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
