"""The launcher on CUDA: run on a GPU machine (the `gpu` CI workflow); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from dpcourse.launch import run_ranks


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
