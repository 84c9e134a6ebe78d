"""dpcourse.timing: the host's clock on the CPU, CUDA events on a GPU (chapters 5 and 7)."""

from __future__ import annotations

import time

import pytest
import torch

from dpcourse import timing
from dpcourse.harness.launch import run_ranks


def test_on_the_cpu_a_stamp_is_the_hosts_perf_counter(monkeypatch):
    readings = iter([10.0, 10.5, 11.25])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(readings))
    clock = timing.DeviceClock("cpu")  # its start reads 10.0
    assert not clock.uses_events
    start, end = clock.stamp(), clock.stamp()
    assert (start.event, end.event) == (None, None)
    assert (clock.seconds(start), clock.seconds(end)) == (0.5, 1.25)
    assert clock.elapsed(start, end) == 0.75


def test_on_the_cpu_it_times_the_work():
    clock = timing.DeviceClock("cpu")
    start = clock.stamp()
    time.sleep(0.02)
    end = clock.stamp()
    assert 0.02 <= clock.elapsed(start, end) < 1.0
    assert 0 <= clock.seconds(start) <= clock.seconds(end) <= clock.host()


@pytest.mark.gpu
def test_on_a_gpu_stamps_are_cuda_events_that_time_the_work():
    device = torch.device("cuda", 0)
    x = torch.randn(4096, 4096, device=device)
    (x @ x).sum().item()  # cuBLAS warmed up
    clock = timing.DeviceClock(device)
    assert clock.uses_events
    host_start = time.perf_counter()
    start = clock.stamp()
    for _ in range(20):
        x = torch.tanh(x @ x)
    end = clock.stamp()
    queued = time.perf_counter() - host_start  # what the host's clock alone would say
    torch.cuda.synchronize(device)
    done = time.perf_counter() - host_start
    assert isinstance(start.event, torch.cuda.Event) and start.host_s is None
    gpu = clock.elapsed(start, end)
    assert 0.5 * done < gpu <= done + 1e-3  # the work, as the synchronised host clock sees it
    assert gpu > queued  # more than the queuing


def timed_backward_on_gpu() -> list[tuple]:
    from dpcourse import runtime
    from dpcourse.ddp import ddp
    from dpcourse.ddp.timeline import timed_backward
    from dpcourse.one_device import models

    device = runtime.device()
    torch.manual_seed(0)
    wrapped = ddp.DDP(models.MLP().to(device), bucket_cap_mb=300 / 2**20)
    x = torch.randn(64, 5, device=device)
    t = timed_backward(wrapped, wrapped(x).square().mean())
    return [(t.backward_s, t.finished_s, b.launched_s, b.completed_s) for b in t.buckets]


@pytest.mark.gpu
def test_the_ddp_timeline_on_a_gpu_is_read_from_events():
    rows = run_ranks(timed_backward_on_gpu, 1, backend="nccl", timeout=240)[0]
    assert len(rows) == 3  # 300-byte buckets of the MLP: (8, 256, 128 | 4096 | 128, 640 bytes)
    for backward, finished, launched, completed in rows:
        assert 0 <= launched <= completed <= finished + 1e-4
        assert launched <= backward <= finished
