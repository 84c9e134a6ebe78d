"""The test session's shared rank pools (tests/conftest.py): used by run_ranks, and usable
again after a run that failed."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dpcourse import runtime
from dpcourse.harness.launch import RankError, run_ranks


def _pid_and_sum() -> tuple[int, float]:
    t = torch.ones(1, device=runtime.device())
    dist.all_reduce(t)
    return os.getpid(), t.item()


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()


def test_run_ranks_uses_the_shared_pool(shared_rank_pools):
    pool = shared_rank_pools[3]
    results = run_ranks(_pid_and_sum, 3)
    assert [s for _, s in results] == [3.0] * 3
    assert [pid for pid, _ in results] == pool.pids  # the pool's ranks ran it
    assert [pid for pid, _ in run_ranks(_pid_and_sum, 3)] == pool.pids  # and run it again


def test_a_failed_run_leaves_the_shared_pool_usable(shared_rank_pools):
    pool = shared_rank_pools[2]
    run_ranks(_pid_and_sum, 2)
    before = pool.pids
    with pytest.raises(RankError, match="rank 1 fails on purpose"):
        run_ranks(_raise_on_rank_one, 2)
    results = run_ranks(_pid_and_sum, 2)
    assert [s for _, s in results] == [2.0, 2.0]
    assert [pid for pid, _ in results] == pool.pids  # fresh ranks, in the same pool
    assert not set(before) & set(pool.pids)
