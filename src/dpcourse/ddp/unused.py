"""Parameters that no rank used: torch's ``find_unused_parameters=True``, a layer on the reducer.

The reducer of :mod:`dpcourse.ddp.buckets` sends a parameter that got no gradient on this rank as
zeros, so that every rank runs the same all-reduces. Where *no* rank used it, torch's DDP with
``find_unused_parameters=True`` leaves its gradient as it was (``None`` after ``zero_grad()``, so
that the optimizer skips it) instead of the zeros, which momentum, Adam and weight decay would
act on. :class:`KeepUnused` does that on top of :class:`~dpcourse.ddp.buckets.BucketManager`, at
the price of one more small all-reduce per step: which parameters each rank used (one int32
each, as torch's DDP sends). :class:`dpcourse.ddp.ddp.DDP` makes its reducer one when given
``find_unused_parameters=True``; section 7.9 shows it.

Chapter 7: parameters no rank used, as torch's DDP treats them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.ddp.buckets import BucketManager, HookedBucketManager

__all__ = ["KeepUnused", "HookedKeepUnused"]


class KeepUnused(BucketManager):
    """:class:`~dpcourse.ddp.buckets.BucketManager` that, after the
    all-reduces, gives a parameter no rank used in this step its gradient
    back as it was. A parameter counts as used on a rank when its gradient
    hook fired since the last :meth:`finish`, in ``no_sync()`` or not."""

    def __init__(self, params: Sequence[nn.Parameter], cap_bytes: float,
                 world_size: int) -> None:
        super().__init__(params, cap_bytes, world_size)
        self.used: set[nn.Parameter] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self.used.add)
                         for p in params]

    def finish(self) -> None:
        """The reducer's finish, then: all-reduce which parameters each rank
        used, and put back the gradients of those that no rank used."""
        flags = [p in self.used for p in self.where]
        before = {p: None if p.grad is None else p.grad.clone()
                  for p, used in zip(self.where, flags, strict=True)
                  if not used}
        super().finish()  # zeros stood in for this rank's unused gradients
        self.used.clear()
        device = self.buckets[0].buffer.device
        users = torch.tensor(flags, dtype=torch.int32, device=device)
        dist.all_reduce(users)
        if not before:  # nothing to put back on this rank (and no need to
            return  # read `users` on the host)
        for p, count in zip(self.where, users.tolist(), strict=True):
            if count == 0:  # no rank used it, this one included
                if before[p] is None:
                    p.grad = None
                else:
                    p.grad.copy_(before[p])


class HookedKeepUnused(HookedBucketManager, KeepUnused):
    """:class:`KeepUnused` whose buckets go through a communication hook
    (:class:`~dpcourse.ddp.buckets.HookedBucketManager`): what ``DDP(find_unused_parameters=True)``
    becomes after ``register_comm_hook`` (chapter 12), as torch's DDP allows both."""
