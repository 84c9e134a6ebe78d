"""FSDP's gradient shards as torch's utilities see them: clipping by the global norm, and a
``GradScaler`` that decides alike on every rank (chapter 9).

After :meth:`~dpcourse.sharding.fsdp.FSDP.finish_gradient_synchronization` each rank holds, for
every sharded parameter, only its rows of the averaged gradient. A utility that reads the
gradients one rank at a time then sees a part and takes it for the whole:

* ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` computes this rank's norm, a
  different one on every rank, and each rank scales its rows by a different factor: the update is
  no longer a multiple of the gradient. :func:`clip_grad_norm_` adds up every rank's part first
  (the sum of squares, or the largest magnitude, gathered from the shard group and added in rank
  order, so that every rank gets the same number, bit for bit) and clips as torch's utility
  does. Parameters outside the sharded layers are whole on every rank and counted once.
* ``GradScaler`` skips the step when *this* rank's gradients are not all finite; a rank whose
  rows are finite would step while another skips. FSDP all-reduces one flag per step for that
  (whether any rank's reduced rows overflowed).

``fully_shard`` gets both from DTensor: a gradient knows it is ``Shard(0)`` of a mesh, so the
norm of a shard is a partial result that DTensor all-reduces, and DTensor max-reduces a
``GradScaler``'s "found inf" over the mesh (``found_inf_reduce_handler`` in torch's
``torch/distributed/tensor/_dispatch.py``). Our shards are plain tensors, so each rank's
gradient shard is marked as a :class:`ShardGrad`, a tensor that behaves as any other except that
it refuses a norm (an error that says to call ``fsdp.clip_grad_norm_``), and that it gives a
``GradScaler`` the flag every rank agreed on. FSDP1 (``FullyShardedDataParallel``) had a
``clip_grad_norm_`` method too, and documented that torch's utility is wrong on sharded
gradients; nothing stopped a learner from calling it.

Chapter 9: clipping and loss scaling on sharded gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dpcourse.collectives.ring import ring_all_gather_, ring_all_reduce

__all__ = ["ShardGrad", "mark_shards", "global_norm", "clip_grad_norm_", "AgreeOnGradients"]

# What a norm of a gradient shard goes through: torch.nn.utils.clip_grad_norm_ and get_total_norm
# call the first two; the others are the same mistake written by hand.
_NORMS = frozenset({torch._foreach_norm, torch.linalg.vector_norm, torch.linalg.norm,
                    torch.linalg.matrix_norm, torch.norm, torch.Tensor.norm})


class ShardGrad(torch.Tensor):
    """This rank's rows of a sharded parameter's averaged gradient: a tensor in every way (the
    optimizer and ``GradScaler`` use it as one; results of operations on it are plain
    tensors), except two. Its norm raises, since it would be this rank's part of the model's
    norm. And ``GradScaler``'s check for infinities on it (``unscale_``) also reports the step's
    overflow flag, which every rank got from the same all-reduce (``overflow``, a 0-dim tensor
    that FSDP updates in place every step): a rank with finite rows, or with no rows at all,
    then skips the step that another rank's overflow skips."""

    overflow: torch.Tensor | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMS:
            raise RuntimeError(
                "a norm of FSDP's gradient shards: this rank holds only its rows of each sharded "
                "gradient, so the norm would be this rank's part of the model's, and every rank "
                "would clip by a different factor. Call fsdp.clip_grad_norm_(max_norm, "
                "norm_type), which adds up every rank's part, instead of "
                "torch.nn.utils.clip_grad_norm_(fsdp.parameters(), ...). (For this rank's part "
                "on purpose: grad.as_subclass(torch.Tensor).norm().)")
        with torch._C.DisableTorchFunctionSubclass():  # plain tensors out, as from any tensor
            result = func(*args, **kwargs)
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            _agree_on_overflow(args[0], args[1])
        return result


def _agree_on_overflow(grads: Iterable[torch.Tensor], found_inf: torch.Tensor) -> None:
    """``found_inf`` (GradScaler's, one device's) raised to 1 if the step's all-reduced flag
    says some rank overflowed; on the device, without waiting for it."""
    flags = {id(g.overflow): g.overflow for g in grads
             if isinstance(g, ShardGrad) and g.overflow is not None}
    for flag in flags.values():
        found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device, found_inf.dtype)))


def mark_shards(params: Iterable[torch.nn.Parameter], overflow: torch.Tensor) -> None:
    """Make each parameter's ``.grad`` a :class:`ShardGrad` (a view: no copy) reporting
    ``overflow``; ``None`` stays ``None``, a gradient marked already keeps its mark."""
    for p in params:
        if p.grad is not None and not isinstance(p.grad, ShardGrad):
            p.grad = p.grad.as_subclass(ShardGrad)
        if isinstance(p.grad, ShardGrad):
            p.grad.overflow = overflow


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, ShardGrad) else t


def global_norm(sharded: list[torch.Tensor], whole: list[torch.Tensor], norm_type: float,
                rank: int, size: int, group: Any = None,
                device: torch.device | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of the model's gradient (a 0-dim fp32 tensor, the same on every
    rank of the group), as ``torch.nn.utils.clip_grad_norm_`` would compute it on the gradients
    whole: ``sharded``, this rank's rows of the sharded ones, summed (as powers, or their
    largest magnitude for the inf-norm) over the ``size`` ranks of ``group`` (this rank is
    ``rank`` in it; hybrid sharding: the node, whose other copies hold the same rows); ``whole``,
    the gradients every rank holds whole, counted once. Every rank of the group must call it.
    ``device``: where the ranks exchange their parts (the collectives' device; by default the
    gradients'), which offloaded shards' gradients are not."""
    inf = norm_type == float("inf")
    device = device or (sharded or whole or [torch.zeros(())])[0].device

    def part(grads: list[torch.Tensor]) -> torch.Tensor:
        grads = [_plain(g).float() for g in grads if g.numel()]
        if not grads:
            return torch.zeros((), device=device)
        if inf:
            return torch.stack([g.abs().max().to(device) for g in grads]).max()
        return sum(torch.linalg.vector_norm(g, norm_type).to(device) ** norm_type for g in grads)

    parts = torch.zeros(size, device=device)  # every rank's part, gathered: one ring
    parts[rank] = part(sharded)
    if size > 1:
        ring_all_gather_(list(parts.split(1)), rank, group)
    own = part(whole)
    if inf:
        return torch.maximum(parts.max(), own)
    return (parts.sum() + own) ** (1.0 / norm_type)  # added in rank order: alike everywhere


@torch.no_grad()
def clip_grad_norm_(sharded: list[torch.Tensor], whole: list[torch.Tensor], max_norm: float,
                    norm_type: float, rank: int, size: int, group: Any = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Scale every gradient (``sharded``: this rank's rows; ``whole``: those held whole) in
    place so that the model's gradient has a ``norm_type``-norm of at most ``max_norm``, by
    torch's formula (``max_norm / (norm + 1e-6)``, at most 1); returns the norm before
    clipping (:func:`global_norm`), written into ``out`` (a 0-dim tensor on the collectives'
    device, made by the caller, on its stream) if given."""
    device = out.device if out is not None else None
    total = global_norm(sharded, whole, float(norm_type), rank, size, group, device)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in [*sharded, *whole]:
        _plain(g).mul_(coef.to(g.device, g.dtype))
    return total if out is None else out.copy_(total)


class AgreeOnGradients:
    """The layer on :class:`~dpcourse.sharding.fsdp.FSDPCore` that leaves the gradients as
    torch's optimizers, ``clip_grad_norm_`` and ``GradScaler`` expect them, every rank agreeing,
    after one small all-reduce per step (a byte for the step and one per parameter):

    * a parameter that no rank used keeps the gradient it had before this backward (``None``
      after ``zero_grad()``, which the optimizer skips, as with torch's DDP and FSDP; zeros would
      move it under momentum, Adam or weight decay). If every parameter got a gradient on this
      rank, nothing is read on the host (torch's DDP reads its map of used parameters only in
      the other case too);
    * if any rank's reduced rows were not finite (each layer's reduce-scatter checks the rows it
      received, after the sum: an fp16 sum can overflow where no rank's gradient did), every
      rank's gradients get a NaN, so that a ``GradScaler`` skips the step on every rank, as with
      DDP's all-reduce;
    * the shards' gradients are marked (:func:`mark_shards`): torch's ``clip_grad_norm_``
      refuses them, and a ``GradScaler`` reads the flag from them, even on a rank without rows.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # this backward, per trainable shard or replicated parameter: whether it got a gradient
        # on this rank, and the .grad it had before (kept if no rank used it)
        self._seen: dict[torch.nn.Parameter, tuple[bool, torch.Tensor | None]] = {}

    def _reduce(self, layer: Any) -> None:
        for i in layer.trainable():  # before the reduce-scatter adds into the shards' .grad
            self._seen[layer.shards[i]] = (layer.has_grad(i), layer.shards[i].grad)
        super()._reduce(layer)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        self._seen.update((p, (p.grad is not None, p.grad)) for p in self.replicated
                          if p.requires_grad)
        super().finish_gradient_synchronization()  # the averages, in every shard's .grad
        # in one order on every rank: the layers', then the replicated parameters'
        trainable = ([layer.shards[i] for layer in self.layers for i in layer.trainable()]
                     + [p for p in self.replicated if p.requires_grad])
        used = [self._seen[p][0] for p in trainable]
        # one message: whether this rank's reduced rows overflowed (1: not finite) and, per
        # parameter, whether it got a gradient here
        flags = torch.ones(1 + len(used), dtype=torch.uint8, device=self.device)
        flags[0] = self._nonfinite
        if not all(used):
            flags[1:] = torch.tensor(used, dtype=torch.uint8).to(flags.device)  # rare: a copy
        if self.world_size > 1:
            self.comm.submit(ring_all_reduce, flags, "max", False, stream="reduce-scatter").wait()
        self._nonfinite.zero_()
        if not all(used):
            for p, anywhere in zip(trainable, flags[1:].tolist(), strict=True):
                if not anywhere:  # no rank used it: the gradient it had
                    p.grad = self._seen[p][1]
        self._seen.clear()
        overflow = flags[0].bool()
        for p in self.parameters():  # a tensor op, not `if overflow:`, which waits for the GPU
            if p.grad is not None and p.grad.numel():  # (offloaded shards': on the host)
                p.grad.view(-1)[:1].masked_fill_(overflow.to(p.grad.device), float("nan"))
        mark_shards([shard for layer in self.layers for shard in layer.shards], overflow)

