"""Benchmarks: ``python -m dpcourse.bench NAME [options]``.

Each benchmark measures the course's implementation and PyTorch's counterpart side by side in
one run (interleaved repetitions, medians), prints the ratios, and can write JSON with the
machine it ran on. Speed is checked here, never by timed unit tests.

Benchmarks:

* ``launch``: the cost of running a trivial function on N ranks. ``run_ranks`` started cold
  (start the ranks, join the group, run, tear down) against ``torch.multiprocessing.spawn`` doing
  the same, and a run on a warm :class:`~dpcourse.launch.RankPool`. Chapter 0 and the launcher's
  docs quote it.
* ``allreduce``: the course's ring, tree and naive all-reduce against ``dist.all_reduce`` on N
  ranks, 1 KiB to 64 MiB, as time ratios to the library and bus bandwidth (chapter 6).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict

from dpcourse import runtime


def _trivial() -> int:
    import torch.distributed as dist

    dist.barrier()
    return dist.get_rank()


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    """What a minimal torch.multiprocessing.spawn job does: join, barrier, leave."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_launch(world_sizes: list[int], repeats: int, warm_repeats: int) -> dict:
    import torch.multiprocessing as mp

    from dpcourse.launch import RankPool, run_ranks

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for n in world_sizes:
        cold, spawn = [], []
        for _ in range(repeats):  # interleaved, so that drifts in machine load hit both alike
            cold.append(_time(lambda n=n: run_ranks(_trivial, n, backend="gloo")))
            spawn.append(
                _time(lambda n=n: mp.spawn(_spawned_rank, args=(n, _free_port()), nprocs=n))
            )
        with RankPool(n, backend="gloo") as pool:
            first = _time(lambda n=n: run_ranks(_trivial, n, backend="gloo"))
            warm = [
                _time(lambda n=n: run_ranks(_trivial, n, backend="gloo"))
                for _ in range(warm_repeats)
            ]
            assert pool.started
        row = {
            "world_size": n,
            "run_ranks_cold_s": statistics.median(cold),
            "torch_spawn_s": statistics.median(spawn),
            "pool_first_run_s": first,
            "pool_warm_run_s": statistics.median(warm),
        }
        row["cold_over_spawn"] = row["run_ranks_cold_s"] / row["torch_spawn_s"]
        row["warm_over_cold"] = row["pool_warm_run_s"] / row["run_ranks_cold_s"]
        rows.append(row)
    return {"rows": rows, "repeats": repeats, "warm_repeats": warm_repeats}


def _print_launch(result: dict) -> None:
    print(
        f"{'ranks':>5} {'run_ranks cold':>15} {'torch spawn':>12} {'cold/spawn':>11} "
        f"{'pool warm':>10} {'warm/cold':>10}"
    )
    for r in result["rows"]:
        print(
            f"{r['world_size']:>5} {r['run_ranks_cold_s']:>14.3f}s {r['torch_spawn_s']:>11.3f}s "
            f"{r['cold_over_spawn']:>10.2f}x {r['pool_warm_run_s'] * 1e3:>8.1f}ms "
            f"{r['warm_over_cold']:>10.4f}"
        )
    print(
        f"(medians of {result['repeats']} cold and {result['warm_repeats']} warm runs; "
        "'torch spawn' = torch.multiprocessing.spawn + init_process_group + barrier + destroy)"
    )


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


def _print_allreduce(result: dict) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpcourse.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="name", required=True)
    p = sub.add_parser("launch", help="start-up cost of run_ranks, cold and pooled, vs mp.spawn")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warm-repeats", type=int, default=50)
    p.add_argument("--json", help="also write the results, with the machine, to this file")
    p = sub.add_parser("allreduce", help="ring, tree and naive all-reduce vs dist.all_reduce")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--largest", type=int, default=2**26, help="largest message in bytes")
    p.add_argument("--json", help="also write the results, with the machine, to this file")
    args = parser.parse_args(argv)

    machine = runtime.describe_machine()
    print(
        f"machine: {machine.cpus} CPU cores, GPUs: {list(machine.gpus) or 'none'}, "
        f"torch {machine.torch_version}"
    )
    if args.name == "launch":
        result = bench_launch(args.world_sizes, args.repeats, args.warm_repeats)
        _print_launch(result)
    else:
        result = bench_allreduce(args.world_size, args.repeats, args.largest)
        _print_allreduce(result)
    if args.json:
        record = {
            "benchmark": args.name,
            "command": "python -m dpcourse.bench "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": asdict(machine),
            **result,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
