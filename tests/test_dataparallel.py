"""Tests for dpcourse.replicas.dataparallel: chapter 2's experiments around nn.DataParallel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcourse import runtime
from dpcourse.one_device import models
from dpcourse.replicas import dataparallel, replication, scatter_gather

mse = nn.functional.mse_loss


def test_input_size_recorder_shares_its_log_between_replicas():
    recorder = dataparallel.InputSizeRecorder(models.MLP())
    replicas = replication.create_replicas(recorder, replication.devices_for(8))
    assert all(r.log is recorder.log for r in replicas)
    inputs = scatter_gather.scatter(torch.randn(30, 5), replication.devices_for(8))
    scatter_gather.parallel_apply(replicas, inputs, threads=False)
    assert [tuple(inp) for _, inp, _ in recorder.log.calls] == [(4, 5)] * 7 + [(2, 5)]
    assert [tuple(out) for _, _, out in recorder.log.calls] == [(4, 2)] * 7 + [(2, 2)]
    recorder.log.clear()
    assert recorder.log.calls == []


def test_nn_data_parallel_on_this_machine():
    recorder = dataparallel.InputSizeRecorder(models.MLP())
    device = replication.devices_for(1)[0]  # cuda:0 on a GPU: DataParallel scatters from there
    dp = nn.DataParallel(recorder.to(device))
    out = dp(torch.randn(30, 5).to(device))
    assert out.shape == (30, 2)
    sizes = sorted(inp[0] for _, inp, _ in recorder.log.calls)
    gpus = runtime.gpu_count()
    if gpus == 0:
        assert dp.device_ids == [] and sizes == [30]  # no GPU: the module, run as it is
    else:
        want = [len(c) for c in torch.chunk(torch.zeros(30), gpus)]
        assert sizes == sorted(want)


@pytest.mark.parametrize(
    "n, sizes", [(1, [30]), (2, [15, 15]), (3, [10, 10, 10]), (8, [4] * 7 + [2])]
)
def test_split_experiment_reproduces_the_tutorial(n, sizes):
    report = dataparallel.split_experiment(n, batch_size=30)
    assert [s[0] for s in report.input_sizes] == sizes
    assert all(tuple(s)[1:] == (5,) for s in report.input_sizes)
    assert [s[0] for s in report.output_sizes] == sizes
    assert tuple(report.output_size) == (30, 2)
    assert report.devices == replication.devices_for(n)
    lines = report.lines()
    assert len(lines) == len(sizes) + 1
    assert lines[0].startswith("  In Model: input size torch.Size([")
    if runtime.gpu_count() < n:
        assert report.how.startswith("dpcourse.replicas.replication")
        assert "this machine has" in report.how
    else:
        assert report.how.startswith("nn.DataParallel")


def test_split_experiment_leaves_devices_idle_when_torch_chunk_does():
    report = dataparallel.split_experiment(8, batch_size=9)
    assert [s[0] for s in report.input_sizes] == [2, 2, 2, 2, 1]


def test_timed_step_is_data_parallel_step_with_a_clock():
    """The clocks are outside the step the book shows; the timed copy takes the same step."""
    batch = (torch.randn(8, 5), torch.randn(8, 2))
    results = []
    for timed in (False, True):
        torch.manual_seed(0)
        master = models.MLP()
        replicas = replication.create_replicas(master, ["cpu"] * 2)
        opt = torch.optim.SGD(master.parameters(), lr=0.1)
        if timed:
            loss, timings = dataparallel.timed_step(master, replicas, batch, mse, opt)
            assert list(timings) == list(dataparallel.PHASES)
            assert all(t >= 0 for t in timings.values())
        else:
            loss = replication.data_parallel_step(master, replicas, batch, mse, opt)
        results.append((loss, master))
    assert results[0][0] == results[1][0]
    assert replication.max_difference(results[0][1], results[1][1]) == 0.0


def test_time_phases_reports_every_phase_for_every_n():
    batch = (torch.randn(16, 5), torch.randn(16, 2))
    times = dataparallel.time_phases(models.MLP(), batch, nn.functional.mse_loss, [1, 3],
                                     repeats=2)
    assert list(times) == [1, 3]
    for phases in times.values():
        assert list(phases) == list(dataparallel.PHASES)
        assert all(t >= 0 for t in phases.values())


def test_time_parallel_apply():
    times = dataparallel.time_parallel_apply(models.MLP(), [1, 2], repeats=2)
    assert list(times) == ["threads", "one after another"]
    assert all(len(v) == 2 and min(v) > 0 for v in times.values())


def test_peak_memory_per_gpu_refuses_the_cpu():
    with pytest.raises(ValueError, match="CUDA GPUs"):
        dataparallel.peak_memory_per_gpu(models.MLP(), (torch.randn(4, 5), torch.randn(4, 2)),
                                         nn.functional.mse_loss, [torch.device("cpu")])


@pytest.mark.multigpu
def test_device_0_holds_the_most_memory():
    devices = replication.devices_for(runtime.gpu_count())
    batch = (torch.randn(4096, 5), torch.randn(4096, 2))
    peaks = dataparallel.peak_memory_per_gpu(models.MLP(hidden=1024), batch,
                                             nn.functional.mse_loss, devices)
    assert len(peaks) == len(devices)
    assert peaks[0] > max(peaks[1:])
