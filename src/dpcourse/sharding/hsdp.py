"""Hybrid sharding (HSDP) from scratch: shard inside a node, replicate across nodes.

FSDP over every rank of a cluster gathers each layer from every rank, so each of its all-gathers
and reduce-scatters crosses the slow links between nodes. HSDP, as ``fully_shard`` does on a 2-D
``DeviceMesh`` of shape (nodes, ranks per node), shards each layer over the k ranks of a node
only and keeps one such sharded copy per node:

1. **forward and backward**: a layer is all-gathered from the k ranks of this rank's node, over
   the fast links inside it (chapter 9's ring, in the node's sub-group);
2. **gradients**: reduce-scattered inside the node (local rank i gets rows i of the node's sum),
   then that chunk alone, 1/k of the layer, is all-reduced across the nodes, among the ranks that
   hold the same rows (one per node), and divided by the world size.

The groups are chapter 10's (:func:`dpcourse.collectives.hierarchical.node_groups`: the node's
ranks, and this rank's peers in the other nodes), so this is chapter 10's two-level all-reduce
with its all-gather moved to the next forward, and the rings are the course's own: no library
collective. Memory per rank falls as 1/k, not 1/N; the bytes across nodes fall from FSDP's two
all-gathers and a reduce-scatter over N ranks to one all-reduce of 1/k of the model per rank
(:func:`node_traffic` counts both; ``tests/test_hsdp.py`` checks it against the bytes counted).
:func:`step_comm_time` prices one step of DDP, FSDP or HSDP with the alpha-beta model of
chapter 6.

Chapter 11: hybrid sharded data parallelism from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dpcourse.collectives.hierarchical import NodeGroups, checked_node_groups
from dpcourse.cost import costmodel
from dpcourse.cost.hardware import Link
from dpcourse.sharding.fsdp import FSDP

__all__ = ["HSDP", "STRATEGIES", "NodeTraffic", "node_traffic", "link_of", "step_comm_time"]

STRATEGIES = ("ddp", "fsdp", "hsdp")


class HSDP(FSDP):
    """``HSDP(model, ranks_per_node, layers=None, groups=None, **fsdp_options)``, on every rank.

    Chapter 9's :class:`~dpcourse.sharding.fsdp.FSDP`, each layer sharded over the
    ``ranks_per_node`` ranks of this rank's node and replicated across the nodes (ranks are
    numbered node-major, as torchrun numbers them; ``ranks_per_node`` must divide the world
    size). ``groups``: from :func:`~dpcourse.collectives.hierarchical.node_groups`, if built
    already (building them is a collective: every rank calls this at the same point). Every
    other option is FSDP's (``layers``, ``mp_policy``, ``reshard_after_forward``, ``prefetch``).
    A step is FSDP's: ``loss.backward(); hsdp.finish_gradient_synchronization(); opt.step()``.
    """

    def __init__(self, module: nn.Module, ranks_per_node: int, *,
                 groups: NodeGroups | None = None, **fsdp_options: Any) -> None:
        groups = _checked_groups(ranks_per_node, groups, fsdp_options)
        # shard inside the node, replicate across it: FSDP's groups, the node
        # and its peers in the other nodes
        super().__init__(module, shard_group=groups.node,
                         replicate_group=groups.peers, **fsdp_options)
        self.groups, self.ranks_per_node = groups, ranks_per_node
        self.nodes = groups.nodes


def _checked_groups(ranks_per_node: int, groups: NodeGroups | None,
                    fsdp_options: dict) -> NodeGroups:
    """HSDP's arguments, checked: no FSDP group passed by hand, and the groups of
    ``ranks_per_node`` (:func:`~dpcourse.collectives.hierarchical.checked_node_groups`)."""
    for taken in ("shard_group", "replicate_group"):
        if taken in fsdp_options:
            raise TypeError(f"HSDP makes {taken} from ranks_per_node; do not pass it")
    return checked_node_groups(ranks_per_node, groups)


# ----------------------------------------------------------------------------- the bytes
@dataclass(frozen=True)
class NodeTraffic:
    """Bytes one node sends in one training step: over the links inside it (``inside``, the
    sum over its ranks) and out through its link to the other nodes (``across``)."""

    inside: float
    across: float


def _check_layout(nodes: int, ranks_per_node: int) -> None:
    for name, value in (("nodes", nodes), ("ranks_per_node", ranks_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def node_traffic(strategy: str, num_params: float, nodes: int, ranks_per_node: int,
                 param_bytes: int = 4, grad_bytes: int = 4,
                 reshard_after_forward: bool = True) -> NodeTraffic:
    """Bytes a node sends per training step with ``strategy`` ("ddp", "fsdp" or "hsdp"), every
    collective a ring as the course builds them, ranks numbered node-major.

    ``num_params``: parameters sharded (DDP: all-reduced); ``param_bytes``: bytes per gathered
    parameter (the policy's ``param_dtype``); ``grad_bytes``: per reduced gradient value
    (``reduce_dtype``). A ring phase (reduce-scatter or all-gather) over n ranks makes each rank
    send (n-1)/n of the data to its right neighbour; in a ring over all N = nodes x k ranks,
    one rank per node (the node's last) sends across, the other k-1 inside.

    * DDP: an all-reduce (two phases) of the gradients over N ranks;
    * FSDP: all-gathers of the parameters (two per step, one without
      ``reshard_after_forward``) and a reduce-scatter of the gradients, over N ranks;
    * HSDP: those same phases over the k ranks of the node (all inside), then an all-reduce of
      each rank's 1/k of the gradients among the ``nodes`` ranks that hold the same rows: each
      of the node's k ranks sends 2(nodes-1)/nodes x (1/k) of the gradients across.

    Exact when every layer's rows divide evenly; the few bytes of flags FSDP all-reduces per step
    are left out. Chapter 11 (exercise ex-11-node-bytes)."""
    _check_layout(nodes, ranks_per_node)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    n, k = nodes * ranks_per_node, ranks_per_node
    params, grads = num_params * param_bytes, num_params * grad_bytes
    gathers = 2 if reshard_after_forward else 1
    if strategy == "hsdp":
        inside = k * (k - 1) / k * (gathers * params + grads)
        across = k * 2 * (nodes - 1) / nodes * grads / k
        return NodeTraffic(inside, across)
    per_rank = (2 * grads if strategy == "ddp" else gathers * params + grads) * (n - 1) / n
    if nodes == 1:
        return NodeTraffic(k * per_rank, 0.0)
    return NodeTraffic((k - 1) * per_rank, per_rank)


# ------------------------------------------------------------------------------ the time
def link_of(rings: int, inter: Link, intra: Link) -> Link:
    """The link that a ring crossing between nodes runs at, when ``rings`` rings (one per GPU of
    the node) share the node's network links side by side: a node with one network card (the
    emulated cluster's) gives each ``inter.beta / rings``; a DGX-style node with a card per GPU
    gives each a card, ``inter.beta``, capped by the links inside the node."""
    if rings < 1:
        raise ValueError(f"rings must be at least 1, got {rings}")
    return Link(f"{inter.name}, shared by {rings} rings", inter.alpha,
                min(inter.beta / rings, intra.beta), inter.source)


def _phase(world: int, nbytes: float, link: Link, calls: int) -> float:
    """One ring phase (half an all-reduce) of ``nbytes`` over ``world`` ranks, cut into
    ``calls`` collectives that each pay the latencies."""
    return costmodel.all_reduce_time("ring", world, nbytes, link.alpha, link.beta, calls) / 2


def step_comm_time(strategy: str, num_params: float, nodes: int, ranks_per_node: int,
                   intra: Link, inter: Link, nics_per_node: int = 1, layers: int = 1,
                   param_bytes: int = 4, grad_bytes: int = 4,
                   reshard_after_forward: bool = True) -> float:
    """Modelled seconds of one step's communication, none of it hidden behind compute, for
    ``strategy`` on ``nodes`` nodes of ``ranks_per_node`` ranks (the alpha-beta model of
    chapter 6, each collective as the course's rings run it; bytes as :func:`node_traffic`).

    ``intra``: the links inside a node; ``inter``: a node's network card. ``nics_per_node``: 1,
    the emulated cluster's nodes, whose ranks share one card; or k, a card per GPU, where a flat
    ring runs as k rings side by side, one through each card with 1/k of the data (NCCL's
    channels; :func:`dpcourse.cost.scaling.cross_node_link`) and each of HSDP's k rings across
    nodes has a card of its own. ``layers``: collectives per phase (FSDP and HSDP gather and
    reduce each layer apart; DDP's all-reduce is one, as if in one bucket)."""
    _check_layout(nodes, ranks_per_node)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if nics_per_node not in (1, ranks_per_node):
        raise ValueError(f"nics_per_node must be 1 or ranks_per_node ({ranks_per_node}), got "
                         f"{nics_per_node}")
    n, k = nodes * ranks_per_node, ranks_per_node
    params, grads = num_params * param_bytes, num_params * grad_bytes
    gathers = 2 if reshard_after_forward else 1
    if strategy == "hsdp":
        inside = (gathers * _phase(k, params, intra, layers) + _phase(k, grads, intra, layers))
        # k rings across nodes, one per local rank, side by side: each all-reduces 1/k
        across = link_of(k // nics_per_node, inter, intra)
        return inside + 2 * _phase(nodes, grads / k, across, layers)
    if nodes == 1:
        flat = intra
    elif nics_per_node == 1:
        flat = inter  # one ring through the node's one card, at its whole rate
    else:  # k rings, each through its own card with 1/k of the data: k cards' worth at once
        flat = Link(f"{k} rings over {k} cards", inter.alpha, min(k * inter.beta, intra.beta),
                    inter.source)
    if strategy == "ddp":
        return 2 * _phase(n, grads, flat, 1)
    return gathers * _phase(n, params, flat, layers) + _phase(n, grads, flat, layers)
