"""The diagnosis lab's tools (section 5): DETAIL checks and the flight recorder on gloo, the
busbw a link allows, and the device clock of the lab's training loop."""

from __future__ import annotations

import pytest

from dpcourse.debugging import diagnosis, diagnosis_tools
from dpcourse.debugging.diagnosis import SKIPPING_RANK, busbw_ceiling
from dpcourse.harness.bench import diagnosis as lab_runs
from dpcourse.harness.launch import run_ranks
from dpcourse.one_device.models import MLP


def _gradient_length(width: int) -> int:
    return sum(p.numel() for p in MLP(width, width, width).parameters())


def test_detail_names_the_mismatched_shapes_that_plain_gloo_does_not():
    narrow, wide = _gradient_length(255), _gradient_length(256)
    with_detail = lab_runs.reproduce_mismatch(detail=True)
    assert not with_detail.error and len(with_detail.outcomes) == diagnosis.LAB_WORLD_SIZE
    for outcome in with_detail.outcomes:
        assert "Detected mismatch between collectives" in outcome
        assert f"TensorShape=[{narrow}]" in outcome and f"TensorShape=[{wide}]" in outcome
    plain = lab_runs.reproduce_mismatch(detail=False)
    assert plain.error or any(o != "finished" for o in plain.outcomes)  # it fails either way
    assert "TensorShape" not in plain.text() and "Detected mismatch" not in plain.text()


def test_detail_turns_the_skipped_collective_into_an_error_naming_the_rank():
    run = lab_runs.reproduce_skip(detail=True)
    assert not run.error
    assert run.outcomes[SKIPPING_RANK] == "finished"
    assert f"Ranks {SKIPPING_RANK} failed to pass monitoredBarrier" in run.outcomes[0]
    others = [r for r in range(diagnosis.LAB_WORLD_SIZE) if r != SKIPPING_RANK]
    assert all(run.outcomes[r].startswith("RuntimeError") for r in others)


@pytest.mark.slow
def test_the_flight_recorder_shows_which_rank_missed_which_collective():
    run = lab_runs.reproduce_skip(records=20)
    assert run.outcomes[SKIPPING_RANK] == "finished"
    assert sorted(run.records) == [0, 1, 2]
    for rank, records in run.records.items():
        expected = 3 if rank == SKIPPING_RANK else 4
        assert [seq for seq, _, _ in records] == list(range(1, expected + 1))
        assert all(op.endswith("all_reduce") for _, op, _ in records)
    assert diagnosis_tools.unmatched_collectives(run.records) == [
        "collective #4: ranks [0, 2] called gloo:all_reduce [[197376]]; ranks [1] did not"
    ]
    if run.analysed:  # torch 2.13's fr_trace reads gloo's records; 2.11's stops at them
        assert "Not all ranks joining collective, sequence number: 4" in run.analysis
        assert f"missing ranks: {{{SKIPPING_RANK}}}" in run.analysis
    else:
        assert "stopped" in run.analysis


def test_unmatched_collectives_names_missing_and_differing_calls():
    records = {
        0: [(1, "all_reduce", [[4]]), (2, "broadcast", [[3]])],
        1: [(1, "all_reduce", [[5]])],
    }
    assert diagnosis_tools.unmatched_collectives(records) == [
        "collective #1: ranks [0] called all_reduce [[4]]; ranks [1] called all_reduce [[5]]",
        "collective #2: ranks [0] called broadcast [[3]]; ranks [1] did not",
    ]
    assert diagnosis_tools.unmatched_collectives({0: records[0], 1: records[0]}) == []


def test_gloo_has_no_per_collective_duration():
    results = run_ranks(diagnosis_tools.collective_duration_on_rank, 2, backend="gloo")
    assert all("doesn't support getDuration" in r for r in results)


def test_busbw_ceiling_is_the_link_rate_unless_the_switch_adds():
    link = 450e9  # NVLink 4 each way (hardware.NVLINK4)
    assert busbw_ceiling(link, 8) == link
    assert busbw_ceiling(link, 8, in_network=True) == pytest.approx(link * 1.75)
    # the busbw a ring would report if each rank moved only S each way in S / link seconds
    from dpcourse.collectives.commbench import bus_bandwidth

    assert bus_bandwidth(2**30, 2**30 / link, 8) == pytest.approx(busbw_ceiling(link, 8, True))
    assert busbw_ceiling(link, 8) < 460e9 < 480e9 < busbw_ceiling(link, 8, in_network=True)


@pytest.mark.gpu
def test_the_training_loop_times_a_gpu_with_cuda_events():
    """On a GPU the loop's clock is CUDA events: a straggler's sleep still shows in compute."""
    times = run_ranks(
        diagnosis.training_steps_on_rank, 1, 4, 1, slow_rank=0, delay_s=0.05, device="cuda"
    )[0]
    assert all(c >= 0.045 for c in times["compute"])
    assert all(s >= c + w for c, w, s in zip(*times.values(), strict=True))
