"""``python -m dpcourse.harness.bench allreduce``: the course's all-reduces against
``dist.all_reduce``.

The ring, tree and naive all-reduce of :mod:`dpcourse.collectives` against the library on N ranks,
1 KiB to 64 MiB, as time ratios to the library and bus bandwidth.

Chapter 6: the all-reduces timed against the library's.
"""

from __future__ import annotations

import argparse
import statistics

from dpcourse.collectives.commbench import (
    IMPLEMENTATIONS,
    all_reduce_samples_on_rank,
    bus_bandwidth,
    default_sizes,
    quantile,
)
from dpcourse.harness.launch import run_ranks

HELP = "ring, tree and naive all-reduce vs dist.all_reduce"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument(
        "--repeats",
        type=int,
        default=100,
        help="repetitions per size (fewer for large sizes: about 1 GiB moved per size)",
    )
    parser.add_argument("--largest", type=int, default=2**26, help="largest message in bytes")


def run(args: argparse.Namespace) -> dict:
    return _bench_allreduce(args.world_size, args.repeats, args.largest)


def _bench_allreduce(world_size: int, repeats: int, largest: int) -> dict:
    """Medians (the target's measure) and 10th percentiles of every implementation and size.

    The 10th percentile is the time without the occasional multi-millisecond stall that a
    blocking wait can suffer on a busy or virtual machine (benchmarks/README.md): it tells
    what the code costs when the machine does not get in the way.
    """


    sizes = default_sizes(largest=largest)
    names = (*IMPLEMENTATIONS, "ring-step-by-step")  # what posting receives ahead buys
    samples = run_ranks(
        all_reduce_samples_on_rank,
        world_size,
        sizes,
        names,
        repeats,
        2**30,
        timeout=1800,
    )[0]
    rows = []
    for i, size in enumerate(sizes):
        library = samples["library"][i]
        row = {"bytes": size, "repetitions": len(library)}
        lib, lib_p10 = statistics.median(library), quantile(library, 0.1)
        for name in names:
            t, p10 = statistics.median(samples[name][i]), quantile(samples[name][i], 0.1)
            row[f"{name}_s"] = t
            row[f"{name}_p10_s"] = p10
            row[f"{name}_busbw_GBps"] = bus_bandwidth(size, t, world_size) / 1e9
            row[f"{name}_over_library"] = t / lib
            row[f"{name}_p10_over_library"] = p10 / lib_p10
        rows.append(row)
    return {"world_size": world_size, "repeats": repeats, "rows": rows}


def report(result: dict) -> None:
    columns = {"ring": "ring", "tree": "tree", "naive": "naive", "ring-step-by-step": "step"}
    print(
        f"all-reduce on {result['world_size']} ranks, float32; time as a ratio to "
        "dist.all_reduce (lower is faster), and bus bandwidth"
    )
    print(
        f"{'size':>9} {'library':>10} "
        + " ".join(f"{label + '/lib':>10}" for label in columns.values())
        + f" {'lib busbw':>10} {'ring busbw':>10} {'ring/lib p10':>13}"
    )
    for r in result["rows"]:
        size = r["bytes"]
        label = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"
        print(
            f"{label:>9} {r['library_s'] * 1e3:>8.2f}ms "
            + " ".join(f"{r[n + '_over_library']:>10.2f}" for n in columns)
            + f" {r['library_busbw_GBps']:>8.2f}GB/s {r['ring_busbw_GBps']:>8.2f}GB/s"
            + f" {r['ring_p10_over_library']:>13.2f}"
        )
    print(
        "(medians of up to "
        f"{result['repeats']} interleaved repetitions, fewer for large sizes; the last column "
        "compares 10th percentiles, the times without stalls; 'step' is the ring without "
        "receives posted ahead, as on NCCL)"
    )
