"""Hierarchical (two-level) all-reduce: rings inside the nodes, rings across them.

A cluster is ``nodes`` machines of ``k`` GPUs each: fast links inside a node (NVLink), a slower
network between nodes. The ranks are numbered node-major, as torchrun and Slurm number them:
ranks 0..k-1 on node 0, k..2k-1 on node 1, and so on (``world_size = nodes * k``); rank r is
local rank ``r % k`` of node ``r // k``. :func:`hierarchical_all_reduce` runs, as Horovod's
hierarchical all-reduce does (``HOROVOD_HIERARCHICAL_ALLREDUCE``):

1. **reduce-scatter inside each node**, a ring over the node's k ranks: local rank i ends with
   chunk i of the node's sum (the tensor cut in k chunks, as ``tensor_split(k)`` cuts it);
2. **all-reduce across nodes** of that chunk only, a ring over the ``nodes`` ranks that have the
   same local rank (i, k+i, 2k+i, ...): now chunk i is reduced over every rank;
3. **all-gather inside each node**, a ring over the node's k ranks: every rank has every chunk.

The three rings are the course's own (:func:`~dpcourse.collectives.ring.reduce_scatter_` and
:func:`~dpcourse.collectives.ring.all_gather_`, run in the sub-groups of :func:`node_groups`),
so the traffic goes through :mod:`.p2p` and is counted, and no library collective is called.
:func:`dpcourse.cost.scaling.hierarchical_all_reduce_time` models the time it takes.

NCCL does not run it. NCCL's ring algorithm is one flat ring through every rank (ordered so that
it leaves and enters each node once, and run as several rings side by side, its channels), and
its tree algorithm is a chain through the GPUs of each node with two binary trees across the
nodes (NCCL 2.4's double binary trees), which NCCL picks for smaller messages and more nodes.
Neither reduces inside the node first and then sends only 1/k across: that is Horovod's choice,
and HSDP's (chapter 11).

Chapter 10: the two-level all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dpcourse.collectives import p2p
from dpcourse.collectives.ops import check_input, finish_
from dpcourse.collectives.ring import all_gather_, reduce_scatter_

__all__ = ["NodeGroups", "node_groups", "checked_node_groups", "hierarchical_all_reduce"]

# Why it pays. A flat ring over all N = nodes * k ranks moves S/N bytes per step for 2(N-1)
# steps, and in every step some rank's hop crosses between nodes: the whole ring goes at the
# pace of the slow link, about 2(N-1)/N * S / (inter-node bandwidth), with 2(N-1) of its
# latencies. Here the slow link carries only step 2: 2(nodes-1)/nodes * S/k bytes per rank,
# k times less, in 2(nodes-1) steps; the other 2(k-1)/k * S bytes go over the fast links inside
# the node. (Each of a node's k rings across nodes runs side by side with the others, on its
# GPU's own network card in a DGX-style node. There a flat all-reduce can also run k rings side
# by side, one per card, with S/k each, as NCCL does: against that, what this saves is mostly
# latency, 2(nodes-1) steps across nodes instead of 2(N-1); see scaling.flat_all_reduce_time.)


@dataclass(frozen=True)
class NodeGroups:
    """One rank's sub-groups for :func:`hierarchical_all_reduce`, made by :func:`node_groups`.

    ``node``: the k ranks of this rank's node, in which its rank is its local rank;
    ``peers``: the ranks with this rank's local rank, one per node, in which its rank is its
    node's index.
    """

    ranks_per_node: int
    nodes: int
    node: dist.ProcessGroup
    peers: dist.ProcessGroup

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def _layout(ranks_per_node: int) -> tuple[int, int]:
    """(rank, world size), after checking that ``ranks_per_node`` divides the world."""
    rank, world = p2p.rank_and_size()
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int):
        raise TypeError(f"ranks_per_node must be an int, got {ranks_per_node!r}")
    if ranks_per_node < 1 or world % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {world}: every node "
            f"must hold as many ranks. Pass a divisor of {world} (ranks_per_node={world} is one "
            "node: a plain ring), or use ring_all_reduce"
        )
    return rank, world


def node_groups(ranks_per_node: int) -> NodeGroups:
    """Make this rank's sub-groups for a world of nodes of ``ranks_per_node`` ranks each.

    ``dist.new_group`` is a collective over the whole world, and costly: **every rank must call
    this, with the same ``ranks_per_node``, at the same point**, since each rank creates every
    node's group and every peer group, its own or not, in the same order (the nodes' groups,
    node 0 first, then the peer groups, local rank 0 first). Build them once and pass them to
    each :func:`hierarchical_all_reduce`. Only in a real process group: the simulated network
    (:mod:`dpcourse.cost.simulate`) has no sub-groups.
    """
    rank, world = _layout(ranks_per_node)
    if p2p.simulated_network() is not None:
        raise RuntimeError(
            "the simulated network has no sub-groups, so hierarchical_all_reduce does not run "
            "on it; run it with dpcourse.harness.launch.run_ranks"
        )
    k, nodes = ranks_per_node, world // ranks_per_node
    node = [dist.new_group(list(range(n * k, (n + 1) * k))) for n in range(nodes)][rank // k]
    peers = [dist.new_group(list(range(i, world, k))) for i in range(k)][rank % k]
    return NodeGroups(ranks_per_node, nodes, node, peers)


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    ranks_per_node: int,
    op: str = "sum",
    groups: NodeGroups | None = None,
    check_shapes: bool = True,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place in two levels (like
    ``dist.all_reduce``); returns it.

    The world is ``world_size // ranks_per_node`` nodes of
    ``ranks_per_node`` ranks, numbered node-major (see the module
    docstring); ``ranks_per_node`` must divide the world size (a ValueError
    otherwise). Any shape and length (even shorter than the world), every
    dtype the backend can send, CPU or CUDA, as
    :func:`~dpcourse.collectives.ring.ring_all_reduce`. ``op``: "sum",
    "mean" (floating point only; divided once, by the world size), "max" or
    "min". ``groups``: from :func:`node_groups`, built once; without them
    each call builds its own, which is a collective and slow (every rank
    must then call this at the same point, as it must anyway).
    ``check_shapes`` first verifies that all ranks passed the same size and
    dtype (one small uncounted message to the right neighbour; benchmarks
    turn it off). The rings run step by step (as on NCCL), on every backend.
    Chapter 10.
    """
    rank, world = _layout(ranks_per_node)
    check_input(tensor, op, check_shapes)
    groups = checked_node_groups(ranks_per_node, groups)
    local, node = rank % ranks_per_node, rank // ranks_per_node
    chunks = tensor.view(-1).tensor_split(ranks_per_node)  # views: in place
    # 1. chunk `local` of the node's sum
    reduce_scatter_(chunks, op, local, groups.node)
    # 2. that chunk summed across the nodes, with the ranks of the same
    #    `local` on the other nodes
    _all_reduce_across_nodes(chunks[local], op, node, groups, world)
    # 3. every chunk to every rank of the node
    all_gather_(chunks, local, groups.node)
    return tensor


def checked_node_groups(ranks_per_node: int,
                        groups: NodeGroups | None = None) -> NodeGroups:
    """``groups``, or :func:`node_groups` made now (a collective, which checks
    that ``ranks_per_node`` divides the world size); a ValueError when
    ``groups`` were made for another layout. Chapters 10 and 11 (HSDP)."""
    if groups is None:
        return node_groups(ranks_per_node)
    world = p2p.rank_and_size()[1]
    if groups.ranks_per_node != ranks_per_node or groups.world_size != world:
        raise ValueError(
            f"groups were made for {groups.nodes} nodes of {groups.ranks_per_node} ranks, not "
            f"{world // ranks_per_node} of {ranks_per_node}: pass node_groups({ranks_per_node})"
        )
    return groups


def _all_reduce_across_nodes(
    chunk: torch.Tensor, op: str, node: int, groups: NodeGroups, world: int
) -> None:
    """Step 2: a ring all-reduce of ``chunk`` among this rank's peers, one per node, where this
    rank is number ``node``. "mean" divides by the whole world's size, once, here: each rank
    divides only the piece it owns, as :func:`~dpcourse.collectives.ring.ring_all_reduce`
    does."""
    pieces = chunk.tensor_split(groups.nodes)
    reduce_scatter_(pieces, op, node, groups.peers)
    finish_(pieces[node], op, world)
    all_gather_(pieces, node, groups.peers)
