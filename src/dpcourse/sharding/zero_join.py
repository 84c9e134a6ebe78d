"""Uneven inputs under ZeRO: torch's ``Join`` for the sharded optimizer (chapter 9).

When one rank runs out of batches before the others, the others wait in their next collective
for a rank that will never send: the job hangs. ``torch.distributed.algorithms.Join`` is torch's
answer (``with Join([model, optimizer]): for batch in my_batches: ...``). A rank that has left
the loop waits in ``Join``'s exit, and once per iteration of the ranks still training it runs
each joinable's **join hook**, which makes the collectives those ranks make in an iteration,
with nothing of its own to add. The ranks still training tell ``Join`` so, once per iteration,
before their own collectives (:func:`notify`: a small all-reduce that the joined ranks answer
with zeros).

For :class:`~dpcourse.sharding.zero.ShardedOptimizer` an iteration is a reduction (end of backward)
and a step, and :class:`ShardedJoinHook` replays them on the joined rank: zero gradients into the
reduce-scatter, the flags of :mod:`dpcourse.sharding.zero_grads` (it used no parameter), the
clipping of the rank's last step if it clipped (the global norm is an all-reduce too), and the
step: the joined rank still owns its shard, so it steps it with the others' average (their sum over
all N ranks, as DDP's join hook divides by the initial world size) and all-gathers it. The weights
are those of DDP with a torch optimizer under ``Join``. Not replayed: a ``GradScaler`` (the joined
rank cannot unscale by a scale it does not see, nor skip with the others), and settings changed
by an LR scheduler on the ranks still training (the joined rank steps its shard with its own
optimizer's settings, as ``ZeroRedundancyOptimizer``'s join hook does). For those, give every
rank the same number of batches (a ``DistributedSampler`` with ``drop_last=True``).

Chapter 9: uneven inputs under ZeRO, torch's Join.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

__all__ = ["JoinableOptimizer", "ShardedJoinHook", "notify"]


def notify(opt: Any) -> None:
    """Inside ``Join``: tell the joined ranks that this one is still training (an all-reduce
    that their join loop answers); outside, or in the join hook itself, nothing."""
    if getattr(opt, "_in_join_hook", False):
        return
    work = Join.notify_join_context(opt)
    if work is not None:
        work.wait()  # torch's all-reduce, before the ring's messages of this iteration


class ShardedJoinHook(JoinHook):
    """What a joined rank does for a :class:`~dpcourse.sharding.zero.ShardedOptimizer` while other
    ranks train: one reduction with zero gradients, the last step's clipping, one step."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt

    def main_hook(self) -> None:
        opt = self.opt
        opt._in_join_hook = True
        try:
            opt.zero_grad(set_to_none=True)  # nothing of its own
            opt.reduce_gradients()
            if opt.last_clip is not None:
                opt.clip_grad_norm_(*opt.last_clip)
            opt.step()
        finally:
            opt._in_join_hook = False

    def post_hook(self, is_last_joiner: bool) -> None:
        # Every rank ends here. Leaving Join ends the notifications too (torch's joinables keep
        # notifying after the context, which costs an all-reduce per iteration).
        self.opt._join_config = _JoinConfig.construct_disabled_join_config()


class JoinableOptimizer(Joinable):
    """The layer that makes :class:`~dpcourse.sharding.zero.ShardedOptimizer` ``Joinable``: each
    reduction first tells ``Join`` that this rank is still training (:func:`notify`), each step
    remembers the clipping it did (for a joined rank to replay it), and :meth:`join_hook` gives
    ``Join`` what a joined rank runs; ``Join``'s own all-reduces run on the rank's device, over
    every rank."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._in_join_hook = False
        self._clipped: tuple[float, float] | None = None  # clip_grad_norm_'s arguments, this step
        self.last_clip: tuple[float, float] | None = None  # ... in the last step (replayed)
        self._join_config = _JoinConfig.construct_disabled_join_config()  # as Joinable's __init__
        super(Joinable, self).__init__(*args, **kwargs)  # on to the core (Joinable's takes none)

    def reduce_gradients(self) -> None:
        notify(self)  # before this iteration's first collective
        super().reduce_gradients()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self._clipped = (max_norm, norm_type)
        return super().clip_grad_norm_(max_norm, norm_type)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        result = super().step(*args, **kwargs)
        self.last_clip, self._clipped = self._clipped, None
        return result

    def join_hook(self, **kwargs: Any) -> ShardedJoinHook:
        return ShardedJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD
