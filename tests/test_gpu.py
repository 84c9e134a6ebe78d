"""The launcher on CUDA: run on a GPU machine (the `gpu` CI workflow); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from dpcourse.harness.launch import run_ranks


def all_reduce_on_my_device():
    import torch.distributed as dist

    from dpcourse import runtime

    info = runtime.current()
    t = torch.full((1000,), float(info.rank + 1), device=info.device)
    dist.all_reduce(t)
    return info.backend, str(info.device), t.sum().item()


@pytest.mark.gpu
def test_nccl_on_one_gpu_world_size_one():
    assert run_ranks(all_reduce_on_my_device, 1, backend="nccl") == [("nccl", "cuda:0", 1000.0)]


@pytest.mark.gpu
def test_several_ranks_share_one_gpu_over_gloo():
    results = run_ranks(all_reduce_on_my_device, 3, backend="gloo")
    gpus = torch.cuda.device_count()
    assert [r[1] for r in results] == [f"cuda:{r % gpus}" for r in range(3)]
    assert {r[2] for r in results} == {6000.0}


@pytest.mark.multigpu
def test_nccl_one_gpu_per_rank():
    results = run_ranks(all_reduce_on_my_device, 2)
    assert results == [("nccl", "cuda:0", 3000.0), ("nccl", "cuda:1", 3000.0)]


def fsdp_streams_on_rank() -> dict:
    """Where FSDP's collectives ran: the communication thread's current device, and whether the
    all-gathers and reduce-scatters ran on the thread's own streams (not the compute stream)."""
    import torch.distributed as dist
    from torch import nn

    from dpcourse import runtime
    from dpcourse.harness.bench.zero import make_mlp
    from dpcourse.sharding.fsdp import FSDP

    device = runtime.device()
    fsdp = FSDP(make_mlp(64, 8).to(device))
    seen = []

    def where(kind, method):
        def run(*args):
            stream = torch.cuda.current_stream()
            seen.append((kind, torch.cuda.current_device(),
                         stream == fsdp.comm.streams[kind],
                         stream == torch.cuda.default_stream(device)))
            return method(*args)
        return run

    for layer in fsdp.layers:
        layer.all_gather = where("all-gather", layer.all_gather)
        layer.reduce_scatter = where("reduce-scatter", layer.reduce_scatter)
    opt = torch.optim.Adam(fsdp.parameters())
    x = torch.randn(4, 64, device=device)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(fsdp(x), torch.zeros(4, 8, device=device)).backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
    state = fsdp.full_state_dict()
    fsdp.close()
    return {"device": device.index, "seen": sorted(set(seen)), "rank": dist.get_rank(),
            "sum": float(sum(v.double().sum() for v in state.values()))}


@pytest.mark.gpu
def test_fsdp_collectives_run_on_the_ranks_device_and_their_own_streams():
    results = run_ranks(fsdp_streams_on_rank, 2)
    for r in results:
        kinds = {kind for kind, *_ in r["seen"]}
        assert kinds == {"all-gather", "reduce-scatter"}, r
        # on the rank's device (the thread's own current device), on its own stream
        assert all(dev == r["device"] and own and not default
                   for _, dev, own, default in r["seen"]), r
    assert results[0]["sum"] == results[1]["sum"]  # the ranks hold the same weights


@pytest.mark.gpu
def test_the_profiled_fsdp_step_shows_gathers_beside_compute():
    from dpcourse.harness.bench.fsdp_streams import stream_overlap, stream_trace_on_rank

    trace = run_ranks(stream_trace_on_rank, 2, True)[0]
    rows = {row for row, *_ in trace["events"]}
    assert {"compute", "all-gather", "reduce-scatter"} <= rows, rows
    overlap = stream_overlap(trace)
    assert overlap["all-gather beside compute"] > 0, overlap
