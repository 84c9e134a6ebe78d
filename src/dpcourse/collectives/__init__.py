"""Collectives built from point-to-point messages.

Each has the semantics of its ``torch.distributed`` counterpart (in place where that one is) and
is tested against it on every world size from 1 to 8 and lengths that do not divide evenly:

=========================  ===================================  =========================
ours                       torch.distributed                    module
=========================  ===================================  =========================
``linear_broadcast``       ``dist.broadcast``                   :mod:`.naive`
``naive_all_reduce``       ``dist.all_reduce``                  :mod:`.naive`
``tree_broadcast``         ``dist.broadcast``                   :mod:`.tree`
``tree_reduce``            ``dist.reduce``                      :mod:`.tree`
``tree_all_reduce``        ``dist.all_reduce``                  :mod:`.tree`
``ring_reduce_scatter``    ``dist.reduce_scatter``              :mod:`.ring`
``ring_all_gather``        ``dist.all_gather``                  :mod:`.ring`
``ring_all_reduce``        ``dist.all_reduce``                  :mod:`.ring`
=========================  ===================================  =========================

``ring_all_reduce``'s phases send their messages through a link: every receive posted before the
first send (:class:`~.ring.PostedAhead`) wherever the backend allows, one step at a time
(:class:`~.ring.StepByStep`) on NCCL. Their traffic goes through :mod:`.p2p`, which counts it
(:func:`count_traffic`). None of them calls a library collective, not even to check shapes.

Chapter 10's two-level all-reduce (rings inside nodes and across them, on the same ring code),
:func:`~dpcourse.collectives.hierarchical.hierarchical_all_reduce`, is imported from
:mod:`dpcourse.collectives.hierarchical`, not from here: this namespace is chapter 6's, and no
chapter imports a later one's module (``lint-imports``: pyproject.toml's contracts).

Chapter 6: the collectives of chapters 5 and 6 in one namespace (the package re-exports both).
"""

from dpcourse.collectives.naive import linear_broadcast, naive_all_reduce
from dpcourse.collectives.p2p import Traffic, count_traffic
from dpcourse.collectives.ring import (
    ring_all_gather,
    ring_all_reduce,
    ring_all_reduce_posted_ahead,
    ring_reduce_scatter,
    ring_schedule,
)
from dpcourse.collectives.tree import tree_all_reduce, tree_broadcast, tree_reduce, tree_rounds

# The all-reduce algorithms by name, as chapter 6, the benchmark and the simulator call them.
ALL_REDUCES = {"ring": ring_all_reduce, "tree": tree_all_reduce, "naive": naive_all_reduce}

__all__ = [
    "ALL_REDUCES",
    "linear_broadcast",
    "naive_all_reduce",
    "tree_broadcast",
    "tree_reduce",
    "tree_all_reduce",
    "tree_rounds",
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_all_reduce_posted_ahead",
    "ring_schedule",
    "count_traffic",
    "Traffic",
]
