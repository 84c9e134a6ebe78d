"""``python -m dpcourse.harness.bench cluster``: the all-reduces over real, rate-limited links.

N emulated machines (:mod:`dpcourse.harness.cluster`: network namespaces joined by veth cables
shaped by ``tc``), one rank each: naive, tree and ring all-reduce timed side by side, each beside
the alpha-beta model's prediction from the link's latency and bandwidth, fitted on ping-pong
messages between two nodes. Needs root (or CAP_NET_ADMIN).

Chapter 6: the all-reduces measured over a network.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from dpcourse.collectives.commbench import ping_pong_on_rank, time_all_reduce_on_rank
from dpcourse.cost import costmodel
from dpcourse.harness.bench import recorded
from dpcourse.harness.cluster import EmulatedCluster
from dpcourse.harness.launch import run_ranks
from dpcourse.plots.cluster import machine_line

HELP = "naive, tree and ring all-reduce on an emulated cluster, against the alpha-beta model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--link", default="1gbit", help="each node's link rate, as tc writes it")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**22, 2**24],
                        help="message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    return measure_on_cluster(args.nodes, args.link, args.sizes, repeats=args.repeats)


def report(result: dict) -> None:
    names = list(result["measured"])
    print(f"all-reduce on {result['nodes']} emulated nodes, {result['link']} links; fitted from "
          f"ping-pong: alpha {result['alpha'] * 1e6:.0f} us, beta "
          f"{result['beta'] * 8 / 1e6:.0f} Mbit/s")
    print(f"{'size':>8} " + " ".join(f"{n + ' (model)':>22}" for n in names)
          + f" {'ring speed-up over naive':>25}")
    for i, size in enumerate(result["sizes"]):
        label = f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size // 2**10} KiB"
        cells = [f"{result['measured'][n][i] * 1e3:9.1f} ms ({result['model'][n][i] * 1e3:7.1f})"
                 for n in names]
        speedup = ""
        if "ring" in names and "naive" in names:
            speedup = f"{result['measured']['naive'][i] / result['measured']['ring'][i]:.2f}x"
        print(f"{label:>8} " + " ".join(f"{c:>22}" for c in cells) + f" {speedup:>25}")
    print("(medians of interleaved repetitions; in brackets the alpha-beta model's time with "
          "the fitted alpha and beta)")


def fit_link_on_cluster(
    cluster, sizes: list[int], repeats: int = 5, peer: int = 1
) -> tuple[float, float, list[int], list[float]]:
    """``(alpha, beta, message sizes, one-way seconds)`` of the link between rank 0 and rank
    ``peer`` of a started :class:`dpcourse.harness.cluster.EmulatedCluster`, fitted
    (:func:`dpcourse.cost.costmodel.fit_link`) on ping-pong messages of ``sizes`` plus a small one
    for the latency and large ones for the bandwidth."""

    link_sizes = sorted({2**12, 2**20, 2**22, *sizes})
    one_way = run_ranks(ping_pong_on_rank, cluster.world_size, link_sizes, repeats, peer,
                        cluster=cluster, timeout=900)[0]
    return (*costmodel.fit_link(link_sizes, one_way), link_sizes, one_way)



def measure_on_cluster(
    nodes: int,
    link: str,
    sizes: list[int],
    names: tuple[str, ...] = ("naive", "tree", "ring"),
    repeats: int = 5,
    budget_bytes: int = 2**26,
) -> dict:
    """Time the all-reduces ``names`` on ``nodes`` emulated machines, one rank each, joined by
    links of rate ``link`` (``"1gbit"``), and predict each from the link's fitted alpha-beta.

    Returns ``{"alpha", "beta", "sizes", "measured": {name: [median s]}, "model": {name: [s]}}``
    (``beta`` in bytes per second). Needs root: :class:`dpcourse.harness.cluster.ClusterUnavailable`
    says what is missing otherwise. Chapter 6 and ``python -m dpcourse.harness.bench cluster``.
    """

    with EmulatedCluster(nodes, link=link) as cluster:
        alpha, beta, link_sizes, one_way = fit_link_on_cluster(cluster, sizes, max(repeats, 5))
        measured = run_ranks(time_all_reduce_on_rank, nodes, sizes, names, repeats,
                             budget_bytes, cluster=cluster, timeout=1800)[0]
    model = {n: [costmodel.all_reduce_time(n, nodes, s, alpha, beta) for s in sizes]
             for n in names}
    return {"nodes": nodes, "link": link, "alpha": alpha, "beta": beta, "sizes": sizes,
            "link_sizes": link_sizes, "ping_pong": one_way, "measured": measured, "model": model}


def recorded_runs(node_counts: Sequence[int], machine: str = "cpu-2core"):
    """``({N: recorded run}, a line saying where and when it was recorded)`` from
    ``benchmarks/<machine>/ch6-cluster-<N>.json`` (the runs chapter 6 shows, read with
    :func:`dpcourse.harness.bench.recorded`) for every N; ``({}, a line saying what is missing)``
    where one is not found."""

    runs = {n: recorded(f"ch6-cluster-{n}", machine) for n in node_counts}
    missing = [n for n, run in runs.items() if run is None]
    if missing:
        return {}, (f"no recorded results either: benchmarks/{machine}/ch6-cluster-N.json for N in "
                    f"{missing} is not next to the dpcourse package (installed without the "
                    "repository?)")
    first = runs[node_counts[0]]
    dates = ", ".join(sorted({run["date"][:10] for run in runs.values()}))
    return runs, (f"recorded on {machine_line(first['machine'])}, {dates} "
                  "(not measured in this build)")

