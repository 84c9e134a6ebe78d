"""The diagnosis lab's runs: each starts a lesson's rank function on N ranks with one fault.

The rank functions and the readings are the lab's own (:mod:`dpcourse.debugging.diagnosis`,
:mod:`dpcourse.debugging.diagnosis_tools`); this module starts them with the launcher and returns
what an engineer would look at: per-rank times (:func:`reproduce_straggler`), the stacks of a hung
run (:func:`reproduce_hang`), step times beside all-reduce times
(:func:`reproduce_small_buckets`), a bandwidth figure (:func:`measure_all_reduce`), and what
PyTorch's own tools say on fresh ranks (:func:`reproduce_mismatch`, :func:`reproduce_skip`).

Appendix: the diagnosis lab (its runs on N ranks).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from dpcourse.collectives import commbench
from dpcourse.ddp.buckets import bucket_assignment
from dpcourse.ddp.workloads import model_and_batch
from dpcourse.debugging.diagnosis import (
    BANDWIDTH_WORLD_SIZE,
    HANG_TIMEOUT_S,
    LAB_WORLD_SIZE,
    SKIPPED_STEP,
    SKIPPING_RANK,
    STRAGGLER_DELAY_S,
    STRAGGLER_RANK,
    AllReduceTiming,
    BucketRun,
    HangReport,
    RankTimes,
    training_steps_on_rank,
)
from dpcourse.debugging.diagnosis_tools import (
    DebugRun,
    analyse_flight_records,
    flight_records,
    mismatch_on_rank,
    skip_on_rank,
)
from dpcourse.harness.bench.ddp import time_variants_on_rank
from dpcourse.harness.launch import RankError, RankPool, RankTimeoutError, run_ranks


def reproduce_straggler(world_size: int = LAB_WORLD_SIZE, steps: int = 12) -> RankTimes:
    """Fault 1: the training loop on ``world_size`` ranks, one of them a straggler."""

    fault = {"slow_rank": STRAGGLER_RANK, "delay_s": STRAGGLER_DELAY_S}
    per_rank = run_ranks(training_steps_on_rank, world_size, steps, backend="gloo", **fault)
    return RankTimes(
        *([statistics.median(t[k]) for t in per_rank] for k in ("compute", "wait", "step"))
    )



def reproduce_hang(
    world_size: int = LAB_WORLD_SIZE, timeout: float = HANG_TIMEOUT_S, steps: int = 4
) -> HangReport:
    """Fault 2: the training loop with one rank skipping one step's all-reduce, ended by
    ``run_ranks``' timeout. Raises ``AssertionError`` if the run finishes instead."""

    fault = {"skip_rank": SKIPPING_RANK, "skip_step": SKIPPED_STEP, "backend": "gloo"}
    start = time.perf_counter()
    try:
        run_ranks(training_steps_on_rank, world_size, steps, 0, timeout=timeout, **fault)
    except RankTimeoutError as exc:
        finished = [r for r in range(world_size) if r not in exc.stalled]
        seconds = time.perf_counter() - start
        return HangReport(list(exc.stalled), finished, dict(exc.stacks), str(exc), seconds)
    raise AssertionError("the run with a skipped all-reduce finished: no hang to diagnose")



def _ddp_and_all_reduces_on_rank(
    model: str, variants: list[str], repeats: int, batch: int, grad_bytes: int
) -> tuple[dict[str, list[float]], list[float]]:
    times = time_variants_on_rank(model, variants, repeats=repeats, warmup=2, batch=batch)
    samples = commbench.all_reduce_samples_on_rank([4, grad_bytes], ("library",), repeats=20)
    return times, [commbench.quantile(ts, 0.1) for ts in samples["library"]]



def reproduce_small_buckets(
    model: str = "transformer", global_batch: int = 64, world_size: int = 2, repeats: int = 10
) -> BucketRun:
    """Fault 3: ``dpcourse.ddp.ddp.DDP`` with ``bucket_cap_mb=0`` (one all-reduce per parameter)
    and with its default 25 MB cap, on ``world_size`` ranks of ``global_batch / world_size``
    samples, against one process on the whole batch (interleaved repetitions, medians)."""

    net, _, _ = model_and_batch(model, 1, 0)
    sizes = [p.numel() * p.element_size() for p in net.parameters()]
    grad_bytes = sum(sizes)
    variants = ["DDP cap 0", "DDP"]

    def one_process() -> float:
        return statistics.median(run_ranks(
            time_variants_on_rank, 1, model, ["none"], repeats, 2, global_batch, backend="gloo"
        )[0]["none"])

    before = one_process()
    args = (model, variants, repeats, global_batch // world_size, grad_bytes)
    times, ar = run_ranks(_ddp_and_all_reduces_on_rank, world_size, *args, backend="gloo")[0]
    # One process is timed twice, before and after the ranks, and the faster run is kept: it
    # runs apart from the ranks, and on a shared machine another job can slow a whole short run
    # (CI once measured 101.9 ms for a step that takes 32.6), never speed it up.
    median = min(before, one_process())
    counts = {"DDP cap 0": len(sizes), "DDP": len(bucket_assignment(sizes, 25 * 2**20))}
    ddp = {v: statistics.median(times[v]) for v in variants}
    return BucketRun(world_size, global_batch, median, ddp, counts, grad_bytes, ar[0], ar[1])



def measure_all_reduce(
    world_size: int = BANDWIDTH_WORLD_SIZE, nbytes: int = 2**24, repeats: int = 5
) -> AllReduceTiming:
    """Fault 4's measurement: the median time of ``dist.all_reduce`` of ``nbytes`` (float32)
    on ``world_size`` ranks, after a warm-up, each repetition as slow as its slowest rank."""

    timing = commbench.time_all_reduce_on_rank
    medians = run_ranks(timing, world_size, [nbytes], ("library",), repeats, backend="gloo")
    return AllReduceTiming(nbytes, world_size, medians[0]["library"][0])


def _run_fresh(fn, world_size: int, *args) -> DebugRun:
    with RankPool(world_size, "gloo") as pool:  # fresh ranks: the settings end with them
        try:
            return DebugRun(outcomes=pool.run(fn, *args, timeout=60))
        except RankError as exc:  # RankDiedError and RankTimeoutError are RankErrors
            return DebugRun(error=f"{type(exc).__name__}: {exc}")



def reproduce_mismatch(detail: bool, world_size: int = LAB_WORLD_SIZE) -> DebugRun:
    """All-reduces of different lengths on different ranks, with or without
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL``."""
    return _run_fresh(mismatch_on_rank, world_size, detail)



def reproduce_skip(
    detail: bool = False, records: int = 0, world_size: int = LAB_WORLD_SIZE
) -> DebugRun:
    """The lab's fault 2 in a group that times out after DEBUG_TIMEOUT_S, with DETAIL checks
    and/or the flight recorder keeping ``records`` collectives per rank, its dumps read back
    (:func:`flight_records`) and analysed by ``fr_trace`` (:func:`analyse_flight_records`)."""
    if not records:
        return _run_fresh(skip_on_rank, world_size, detail, 0, None)
    with tempfile.TemporaryDirectory() as dump_dir:
        run = _run_fresh(skip_on_rank, world_size, detail, records, dump_dir)
        run.records = flight_records(dump_dir)
        run.analysed, run.analysis = analyse_flight_records(dump_dir)
    return run

