"""``python -m dpcourse.bench allreduce``: the course's all-reduces against ``dist.all_reduce``.

The ring, tree and naive all-reduce of :mod:`dpcourse.collectives` against the library on N ranks,
1 KiB to 64 MiB, as time ratios to the library and bus bandwidth (chapter 6).
"""

from __future__ import annotations

import argparse

HELP = "ring, tree and naive all-reduce vs dist.all_reduce"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--largest", type=int, default=2**26, help="largest message in bytes")


def run(args: argparse.Namespace) -> dict:
    return bench_allreduce(args.world_size, args.repeats, args.largest)


def bench_allreduce(world_size: int, repeats: int, largest: int) -> dict:
    from dpcourse.commbench import (
        IMPLEMENTATIONS,
        bus_bandwidth,
        default_sizes,
        time_all_reduce_on_rank,
    )
    from dpcourse.launch import run_ranks

    sizes = default_sizes(largest=largest)
    medians = run_ranks(
        time_all_reduce_on_rank, world_size, sizes, IMPLEMENTATIONS, repeats, timeout=1800
    )[0]
    rows = []
    for i, size in enumerate(sizes):
        row = {"bytes": size}
        for name in IMPLEMENTATIONS:
            t = medians[name][i]
            row[f"{name}_s"] = t
            row[f"{name}_busbw_GBps"] = bus_bandwidth(size, t, world_size) / 1e9
            row[f"{name}_over_library"] = t / medians["library"][i]
        rows.append(row)
    return {"world_size": world_size, "repeats": repeats, "rows": rows}


def report(result: dict) -> None:
    names = ("ring", "tree", "naive")
    print(
        f"all-reduce on {result['world_size']} ranks, float32; time as a ratio to "
        "dist.all_reduce (lower is faster), and bus bandwidth"
    )
    print(
        f"{'size':>9} {'library':>10} "
        + " ".join(f"{n + '/lib':>10}" for n in names)
        + f" {'lib busbw':>10} {'ring busbw':>10}"
    )
    for r in result["rows"]:
        size = r["bytes"]
        label = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 2**10} KiB"
        print(
            f"{label:>9} {r['library_s'] * 1e3:>8.2f}ms "
            + " ".join(f"{r[n + '_over_library']:>10.2f}" for n in names)
            + f" {r['library_busbw_GBps']:>8.2f}GB/s {r['ring_busbw_GBps']:>8.2f}GB/s"
        )
