"""The diagnosis lab (appendix): each injected fault shows the signature the lab teaches."""

from __future__ import annotations

import re

import pytest

from dpcourse.debugging import diagnosis
from dpcourse.debugging.diagnosis import AllReduceTiming, colleague_reports
from dpcourse.harness.bench import diagnosis as lab_runs
from dpcourse.harness.launch import run_ranks


def test_the_training_loop_times_every_step_after_the_warm_up():
    times = run_ranks(diagnosis.training_steps_on_rank, 2, 5, 2, backend="gloo")
    for t in times:
        assert set(t) == {"compute", "wait", "step"}
        assert all(len(v) == 3 for v in t.values())
        assert all(s >= c + w for c, w, s in zip(t["compute"], t["wait"], t["step"], strict=True))


def test_a_straggler_computes_longer_and_the_others_wait_for_it_in_the_all_reduce():
    times = lab_runs.reproduce_straggler(steps=8)
    delay, slow = diagnosis.STRAGGLER_DELAY_S, diagnosis.STRAGGLER_RANK
    others = [r for r in range(diagnosis.LAB_WORLD_SIZE) if r != slow]
    assert times.compute[slow] >= delay  # it slept that long before its all-reduce, every step
    assert max(range(len(times.compute)), key=times.compute.__getitem__) == slow
    assert all(times.wait[r] > times.wait[slow] for r in others)
    assert all(times.wait[r] > delay / 2 for r in others)  # the others wait out its delay
    assert "all-reduce" in times.table() and len(times.table().splitlines()) == 4


def test_a_skipped_all_reduce_hangs_the_others_until_the_timeout():
    report = lab_runs.reproduce_hang(timeout=3.0)
    assert report.finished == [diagnosis.SKIPPING_RANK]
    assert report.stalled == [0, 2]
    for r in report.stalled:
        assert "dist.all_reduce(flat, group=group)" in report.stacks[r]
        assert "training_steps_on_rank" in report.stacks[r]
    assert "did not finish within the timeout of 3 s" in report.message
    assert 3.0 <= report.seconds < 30


def test_the_hang_needs_the_skip():
    """Without the fault the same loop finishes on every rank."""
    times = run_ranks(diagnosis.training_steps_on_rank, 3, 4, 0, backend="gloo", timeout=60)
    assert [len(t["step"]) for t in times] == [4, 4, 4]


@pytest.mark.slow
def test_small_buckets_run_measures_one_process_both_ddps_and_the_all_reduces():
    run = lab_runs.reproduce_small_buckets(repeats=3)
    assert run.all_reduces == {"DDP cap 0": 69, "DDP": 1}  # the TinyTransformer's 69 tensors
    assert run.grad_bytes == 4 * 172_237
    assert set(run.ddp) == {"DDP cap 0", "DDP"}
    assert all(t > 0 for t in [run.one_process, *run.ddp.values(), run.tiny_all_reduce])
    text = run.evidence()
    assert "all-reduces per step in the colleague's DDP: 69" in text
    assert "cap" not in text  # the evidence does not give the answer away


def _figure(line: str) -> float:
    return float(re.search(r"algbw ([\d.]+) GB/s", line).group(1))


def test_the_colleagues_reports_carry_one_known_mistake_each():
    t = AllReduceTiming(nbytes=2**24, world_size=4, seconds=0.02)
    assert t.algbw == pytest.approx(2**24 / 0.02)
    assert t.busbw == pytest.approx(t.algbw * 1.5)
    reports = colleague_reports(t)
    true_gbps = t.algbw / 1e9
    assert _figure(reports["A"]) / true_gbps == pytest.approx(1.5, rel=1e-3)  # busbw
    assert _figure(reports["B"]) / true_gbps == pytest.approx(1e9 / 2**30, rel=1e-3)  # GiB
    assert "16.78 MB" in reports["A"] and "20.00 ms" in reports["B"]
    assert "16 MiB" in t.line() and "busbw" in t.line()


def test_measure_all_reduce_times_the_library_all_reduce_on_four_ranks():
    t = lab_runs.measure_all_reduce(nbytes=2**16, repeats=3)
    assert t.world_size == diagnosis.BANDWIDTH_WORLD_SIZE == 4
    assert t.nbytes == 2**16 and 0 < t.seconds < 5
