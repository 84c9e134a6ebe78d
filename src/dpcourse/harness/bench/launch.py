"""``python -m dpcourse.harness.bench launch``: the cost of running a trivial function on N ranks.

``run_ranks`` started cold (start the ranks, join the group, run, tear down), with ranks forked
from the fork server (the default) and as fresh interpreters (``DPCOURSE_START_METHOD=spawn``),
against ``torch.multiprocessing.spawn`` doing the same, and a run on a warm
:class:`~dpcourse.harness.launch.RankPool`. The introduction and the launcher's docs quote it.

Chapter 0: the course-wide runtime and launcher.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dpcourse.harness.launch import RankPool, run_ranks

HELP = "start-up cost of run_ranks, cold and pooled, vs torch.multiprocessing.spawn"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warm-repeats", type=int, default=50)


def run(args: argparse.Namespace) -> dict:
    return _bench_launch(args.world_sizes, args.repeats, args.warm_repeats)


def _trivial() -> int:
    dist.barrier()
    return dist.get_rank()


def _spawned_rank(rank: int, world_size: int, port: int) -> None:
    """What a minimal torch.multiprocessing.spawn job does: join, barrier, leave."""

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _time_spawned(fn: Callable[[], object]) -> float:
    """``_time(fn)`` with run_ranks starting fresh interpreters instead of forking."""
    with mock.patch.dict(os.environ, DPCOURSE_START_METHOD="spawn"):
        return _time(fn)


def _bench_launch(world_sizes: list[int], repeats: int, warm_repeats: int) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(_trivial, 1, backend="gloo")  # starts the fork server (once per caller)
    rows = []
    for n in world_sizes:
        cold, cold_spawned, spawn = [], [], []
        for _ in range(repeats):  # interleaved, so that drifts in machine load hit all alike
            cold.append(_time(lambda n=n: run_ranks(_trivial, n, backend="gloo")))
            cold_spawned.append(_time_spawned(lambda n=n: run_ranks(_trivial, n, backend="gloo")))
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
            "run_ranks_cold_spawned_s": statistics.median(cold_spawned),
            "torch_spawn_s": statistics.median(spawn),
            "pool_first_run_s": first,
            "pool_warm_run_s": statistics.median(warm),
        }
        row["cold_over_spawn"] = row["run_ranks_cold_s"] / row["torch_spawn_s"]
        row["spawned_over_spawn"] = row["run_ranks_cold_spawned_s"] / row["torch_spawn_s"]
        row["warm_over_cold"] = row["pool_warm_run_s"] / row["run_ranks_cold_s"]
        rows.append(row)
    return {"rows": rows, "repeats": repeats, "warm_repeats": warm_repeats}


def report(result: dict) -> None:
    print(
        f"{'ranks':>5} {'cold, forked':>13} {'cold, fresh':>12} {'torch spawn':>12} "
        f"{'forked/spawn':>13} {'fresh/spawn':>12} {'pool warm':>10} {'warm/cold':>10}"
    )
    for r in result["rows"]:
        print(
            f"{r['world_size']:>5} {r['run_ranks_cold_s']:>12.3f}s "
            f"{r['run_ranks_cold_spawned_s']:>11.3f}s {r['torch_spawn_s']:>11.3f}s "
            f"{r['cold_over_spawn']:>12.2f}x {r['spawned_over_spawn']:>11.2f}x "
            f"{r['pool_warm_run_s'] * 1e3:>8.1f}ms {r['warm_over_cold']:>10.4f}"
        )
    print(
        f"(medians of {result['repeats']} cold and {result['warm_repeats']} warm runs; 'forked': "
        "run_ranks with ranks forked from its fork server; 'fresh': DPCOURSE_START_METHOD=spawn; "
        "'torch spawn' = torch.multiprocessing.spawn + init_process_group + barrier + destroy)"
    )
