"""``python -m dpcourse.harness.bench hierarchical``: the flat ring against the two-level
all-reduce on an emulated cluster whose links between nodes are slower than inside them.

``nodes`` emulated machines (:mod:`dpcourse.harness.cluster`) of ``ranks_per_node`` ranks each: the
links between nodes shaped to ``link``, the loopback inside each node left at memory speed (or
shaped to ``node_link``). Both all-reduces are the course's own
(:func:`~dpcourse.collectives.ring.ring_all_reduce` over all ranks,
:func:`~dpcourse.collectives.hierarchical.hierarchical_all_reduce`), timed side by side, and set
beside the model of :mod:`dpcourse.cost.scaling` with each link's alpha and beta fitted from
ping-pong messages. Needs root (or CAP_NET_ADMIN).

The emulated node has one network link that its ranks share (as a node with one NIC): the
two-level all-reduce's rings across nodes run side by side over it, so the model gives each
of them ``beta / ranks_per_node``, and the flat ring, one ring, goes through it whole. A
DGX-style node has a NIC per GPU, and there both get k of them: each of the two-level rings its
own, and the flat all-reduce k rings side by side with 1/k of the data each, one per NIC
(NCCL's channels; :func:`dpcourse.cost.scaling.flat_all_reduce_time`). There the two-level one saves
latency (2(nodes-1) steps across nodes, not 2(N-1)) and sends (nodes-1)/nodes of its share
through a NIC against the flat ring's (N-1)/N, not k times less.

Chapter 10: the two-level all-reduce measured.
"""

from __future__ import annotations

import argparse

from dpcourse.collectives import commbench
from dpcourse.collectives.hierarchical import hierarchical_all_reduce, node_groups
from dpcourse.collectives.ring import ring_all_reduce
from dpcourse.cost import costmodel, hardware, scaling
from dpcourse.harness.bench.cluster import fit_link_on_cluster
from dpcourse.harness.cluster import EmulatedCluster
from dpcourse.harness.launch import run_ranks

HELP = "flat ring vs two-level all-reduce on an emulated cluster with slow links between nodes"

__all__ = ["measure_two_level"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--link", default="400mbit", help="between nodes, as tc writes it")
    parser.add_argument("--node-link", default=None, help="inside a node (default: unshaped)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**22, 2**24])
    parser.add_argument("--repeats", type=int, default=5)


def _two_level_samples_on_rank(sizes: list[int], ranks_per_node: int, repeats: int) -> dict:
    """Run on every rank: median seconds of the flat ring and of the two-level all-reduce for
    each size (float32, interleaved repetitions, the slowest rank counts)."""

    groups = node_groups(ranks_per_node)  # a collective: every rank, once, up front
    fns = {
        "flat ring": lambda t: ring_all_reduce(t, check_shapes=False),
        "two-level": lambda t: hierarchical_all_reduce(
            t, ranks_per_node, groups=groups, check_shapes=False
        ),
    }
    return commbench.time_all_reduce_on_rank(sizes, tuple(fns), repeats, implementations=fns)


def measure_two_level(
    nodes: int = 2,
    ranks_per_node: int = 2,
    link: str = "400mbit",
    node_link: str | None = None,
    sizes: list[int] = (2**20, 2**22, 2**24),
    repeats: int = 5,
) -> dict:
    """Measure both all-reduces on an emulated cluster and model them (see the module).

    Returns ``{"sizes", "measured": {"flat ring", "two-level"}, "model": {...}, "inter":
    (alpha, beta), "intra": (alpha, beta), ...}``, times in seconds, beta in bytes per second.
    """

    sizes = list(sizes)
    k, world = ranks_per_node, nodes * ranks_per_node
    with EmulatedCluster(nodes, k, link=link, node_link=node_link) as cluster:
        # rank 0 to rank k crosses between nodes; rank 0 to rank 1 stays inside node 0
        inter = fit_link_on_cluster(cluster, sizes, peer=k)[:2]
        intra = fit_link_on_cluster(cluster, sizes, peer=1)[:2]
        measured = run_ranks(_two_level_samples_on_rank, world, sizes, k, repeats,
                             cluster=cluster, timeout=1800)[0]
    inside = hardware.Link("inside a node (fitted)", *intra, "ping-pong, this run")
    # the node's one link is shared by its k rings across nodes: each gets 1/k of it
    across = hardware.Link("between nodes (fitted), per ring", inter[0], inter[1] / k,
                          "ping-pong, this run")
    model = {
        "flat ring": [costmodel.all_reduce_time("ring", world, s, *inter) for s in sizes],
        "two-level": [scaling.hierarchical_all_reduce_time(s, world, k, inside, across)
                      for s in sizes],
    }
    return {"nodes": nodes, "ranks_per_node": k, "link": link, "node_link": node_link,
            "sizes": sizes, "inter": inter, "intra": intra, "measured": measured, "model": model}


def run(args: argparse.Namespace) -> dict:
    return measure_two_level(args.nodes, args.ranks_per_node, args.link, args.node_link,
                             args.sizes, args.repeats)


def report(result: dict) -> None:
    (ia, ib), (ja, jb) = result["inter"], result["intra"]
    print(f"{result['nodes']} emulated nodes x {result['ranks_per_node']} ranks; between nodes "
          f"{result['link']} (fitted: alpha {ia * 1e6:.0f} us, beta {ib * 8 / 1e6:.0f} Mbit/s); "
          f"inside ({result['node_link'] or 'unshaped'}: alpha {ja * 1e6:.0f} us, beta "
          f"{jb * 8 / 1e9:.1f} Gbit/s)")
    print(f"{'size':>8} {'flat ring (model)':>22} {'two-level (model)':>22} "
          f"{'speed-up':>9} {'model':>6}")
    for i, size in enumerate(result["sizes"]):
        flat, two = result["measured"]["flat ring"][i], result["measured"]["two-level"][i]
        mflat, mtwo = result["model"]["flat ring"][i], result["model"]["two-level"][i]
        print(f"{size / 2**20:6g} MiB {flat * 1e3:10.1f} ms ({mflat * 1e3:7.1f}) "
              f"{two * 1e3:10.1f} ms ({mtwo * 1e3:7.1f}) {flat / two:8.2f}x {mflat / mtwo:5.2f}x")
    print("(medians of interleaved repetitions; in brackets the model with alpha and beta "
          "fitted from ping-pong)")
