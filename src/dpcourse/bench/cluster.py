"""``python -m dpcourse.bench cluster``: the all-reduces over real, rate-limited links.

N emulated machines (:mod:`dpcourse.cluster`: network namespaces joined by veth cables shaped
by ``tc``), one rank each: naive, tree and ring all-reduce timed side by side, each beside the
alpha-beta model's prediction from the link's latency and bandwidth, fitted on ping-pong
messages between two nodes. Needs root (or CAP_NET_ADMIN).

Chapter 6: the all-reduces measured over a network.
"""

from __future__ import annotations

import argparse

HELP = "naive, tree and ring all-reduce on an emulated cluster, against the alpha-beta model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--link", default="1gbit", help="each node's link rate, as tc writes it")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**22, 2**24],
                        help="message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict:
    from dpcourse.commbench import measure_on_cluster

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
