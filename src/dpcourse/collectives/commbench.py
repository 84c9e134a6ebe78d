"""Timing all-reduce implementations side by side on N ranks (chapter 6, ``bench allreduce``).

Repetitions are interleaved (ring, tree, naive, library, ring, tree, ...) so that drifts in the
machine's load hit every implementation alike; each repetition starts after a barrier and
counts the slowest rank; the result is the median. Bus bandwidth follows nccl-tests:
``algbw = bytes / time`` and ``busbw = algbw * 2(N-1)/N``, which makes a bandwidth-optimal
all-reduce score the link's bandwidth whatever N is. :func:`cpu_per_call_on_rank` adds the CPU
time of the backend's threads per call: where cores are few, gloo's I/O thread polling for a busy
connection is what stalls calls by a few milliseconds (chapter 6).

:func:`measure_on_cluster` runs the same timing on an emulated cluster
(:mod:`dpcourse.harness.cluster`), with one link's latency and bandwidth fitted from ping-pong
messages (:func:`ping_pong_on_rank`), so that each algorithm's time can be set beside the
alpha-beta model's prediction from the network alone.

Chapter 6: timing the all-reduces side by side on N ranks.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dpcourse import collectives as C
from dpcourse import runtime

__all__ = [
    "IMPLEMENTATIONS",
    "time_all_reduce_on_rank",
    "all_reduce_samples_on_rank",
    "cpu_per_call_on_rank",
    "bus_bandwidth",
    "default_sizes",
    "quantile",
    "slowest_rank",
    "ping_pong_on_rank",
]

IMPLEMENTATIONS = ("library", "ring", "tree", "naive")


def _implementation(name: str):
    """``name``: "library", a key of ``collectives.ALL_REDUCES`` ("ring", "tree", "naive"), or
    "ring-step-by-step": the ring without receives posted ahead, as it runs on NCCL."""
    if name == "library":
        return dist.all_reduce
    if name == "ring-step-by-step":
        return lambda t: C.ring_all_reduce(t, check_shapes=False, post_ahead=False)
    fn = C.ALL_REDUCES[name]
    return lambda t: fn(t, check_shapes=False)


def default_sizes(smallest: int = 2**10, largest: int = 2**26, factor: int = 4) -> list[int]:
    """Message sizes in bytes: 1 KiB, 4 KiB, ... 64 MiB."""
    sizes, s = [], smallest
    while s <= largest:
        sizes.append(s)
        s *= factor
    return sizes


def time_all_reduce_on_rank(
    sizes: list[int],
    names: tuple[str, ...] = IMPLEMENTATIONS,
    repeats: int = 10,
    budget_bytes: int = 2**28,
    implementations: dict | None = None,
) -> dict[str, list[float]]:
    """Run on every rank (with :func:`dpcourse.harness.launch.run_ranks`): median seconds per
    all-reduce for each implementation and size (float32). Large sizes get fewer repetitions, so
    that each size moves at most about ``budget_bytes`` per implementation (at least 3 repetitions).
    ``implementations`` maps other names to in-place all-reduce functions (chapter 10 times
    its two-level all-reduce so)."""
    samples = all_reduce_samples_on_rank(sizes, names, repeats, budget_bytes, implementations)
    return {n: [statistics.median(ts) for ts in samples[n]] for n in names}


def all_reduce_samples_on_rank(
    sizes: list[int],
    names: tuple[str, ...] = IMPLEMENTATIONS,
    repeats: int = 10,
    budget_bytes: int = 2**28,
    implementations: dict | None = None,
) -> dict[str, list[list[float]]]:
    """Like :func:`time_all_reduce_on_rank`, but every repetition's time (of the slowest rank):
    ``result[name][i]`` lists the times of size ``sizes[i]``."""
    device = runtime.device()
    given = implementations or {}
    fns = {n: given[n] if n in given else _implementation(n) for n in names}
    samples: dict[str, list[list[float]]] = {n: [] for n in names}
    for size in sizes:
        x = torch.ones(size // 4, device=device)
        reps = max(3, min(repeats, budget_bytes // size))
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:  # one warm-up each: first use allocates buffers and connections
            fns[n](x.clone())
        for _ in range(reps):
            for n in names:
                y = x.clone()
                dist.barrier()
                start = time.perf_counter()
                fns[n](y)
                runtime.synchronize(device)
                times[n].append(slowest_rank(time.perf_counter() - start, device))
        for n in names:
            samples[n].append(times[n])
    return samples


def cpu_per_call_on_rank(
    sizes: list[int], names: tuple[str, ...] = ("library", "ring"), repeats: int = 100
) -> dict[str, list[list[tuple[float, float, float]]]]:
    """Run on every rank: ``result[name][i]`` lists, per repetition at ``sizes[i]`` bytes, the
    largest over the ranks of (wall seconds, CPU seconds of the calling thread, CPU seconds of
    the rank's other threads). The other threads are the backend's: on gloo, its I/O thread,
    which reads every message, and its worker threads, which run the library's collectives.

    Why CPU time: where a rank has fewer free cores than busy threads, a call is slow when one
    of them waits for a core, and the CPU that the others burn meanwhile says which (chapter 6:
    gloo's I/O thread polls while a send holds its connection)."""
    device = runtime.device()
    fns = {n: _implementation(n) for n in names}
    result: dict[str, list[list[tuple[float, float, float]]]] = {n: [] for n in names}
    for size in sizes:
        x = torch.ones(size // 4, device=device)
        for n in names:  # warm-up, as above
            fns[n](x.clone())
        rows: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
        for _ in range(repeats):
            for n in names:
                y = x.clone()
                dist.barrier()
                wall, caller, process = time.perf_counter(), time.thread_time(), time.process_time()
                fns[n](y)
                runtime.synchronize(device)
                caller = time.thread_time() - caller
                others = time.process_time() - process - caller
                t = torch.tensor([time.perf_counter() - wall, caller, others],
                                 dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows[n].append(tuple(t.tolist()))
        for n in names:
            result[n].append(rows[n])
    return result


def slowest_rank(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds``: a collective is as slow as its slowest rank.
    Run on every rank; ``device`` is the rank's (NCCL reduces only GPU tensors)."""
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def quantile(times: list[float], q: float) -> float:
    """The ``q`` quantile of ``times`` (0.5: the median; 0.1: the 10th percentile, the time
    without the stalls a busy or virtual machine adds now and then)."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bus_bandwidth(size_bytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, in bytes per second."""
    return size_bytes / seconds * 2 * (world_size - 1) / world_size


def ping_pong_on_rank(sizes: list[int], repeats: int = 5, peer: int = 1) -> list[float]:
    """Run on every rank: ranks 0 and ``peer`` bounce a message of each size (bytes) back and
    forth; returns the median one-way seconds per size (half a round trip), the others idle."""
    rank = dist.get_rank()
    one_way = []
    for size in sizes:
        x = torch.zeros(max(1, size // 4))
        times = []
        for _ in range(repeats + 1):  # the first opens the connection: not counted
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, peer)
                dist.recv(x, peer)
            elif rank == peer:
                dist.recv(x, 0)
                dist.send(x, 0)
            times.append((time.perf_counter() - start) / 2)
        one_way.append(statistics.median(times[1:]))
    return one_way


