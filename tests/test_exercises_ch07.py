"""Chapter 7's checks: the references pass; plausible wrong answers fail, saying why."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from dpcourse import buckets, ddp
from dpcourse.exercises import ch07, run_check
from dpcourse.launch import RankPool


@pytest.fixture
def short_timeouts(monkeypatch):
    monkeypatch.setattr(ch07, "RANK_TIMEOUT", 20.0)


@pytest.fixture(scope="module")
def pools():
    """The rank checks run on 2 and 3 ranks: keep those ranks between checks."""
    with RankPool(2), RankPool(3):
        yield


# --------------------------------------------------------------------------- buckets
def buckets_in_forward_order(sizes, cap):
    buckets, current, size = [], [], 0
    for i, s in enumerate(sizes):
        current.append(i)
        size += s
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


# closing a bucket before the parameter that would take it past the cap (none exceeds it)
buckets_that_close_early = ch07._closing_early


def one_bucket_each_but_forgets_the_last(sizes, cap):
    return [[i] for i in reversed(range(len(sizes)))][:-1]


def test_bucket_check():
    assert run_check("ex-7-buckets", buckets.bucket_assignment).passed
    result = run_check("ex-7-buckets", buckets_in_forward_order)
    assert not result.passed and "last parameter backwards" in result.message
    result = run_check("ex-7-buckets", buckets_that_close_early)
    assert not result.passed and "before a parameter that would take it past" in result.message
    result = run_check("ex-7-buckets", one_bucket_each_but_forgets_the_last)
    assert not result.passed and "exactly one bucket" in result.message


# --------------------------------------------------------------------------- the hook
def launch_reference(param, pending):
    param.grad.div_(dist.get_world_size())
    pending.append(dist.all_reduce(param.grad, async_op=True))


def divide_after_launching(param, pending):
    """Launch, then divide: on gloo the mean often comes out anyway, but it is a race."""
    pending.append(dist.all_reduce(param.grad, async_op=True))
    param.grad.div_(dist.get_world_size())


def launch_blocking(param, pending):
    param.grad.div_(dist.get_world_size())
    pending.append(dist.all_reduce(param.grad))  # returns None


def launch_sum(param, pending):
    pending.append(dist.all_reduce(param.grad, async_op=True))


def launch_and_forget(param, pending):
    param.grad.div_(dist.get_world_size())
    dist.all_reduce(param.grad, async_op=True).wait()


def test_hook_check(short_timeouts, pools):
    assert run_check("ex-7-hook", launch_reference).passed
    result = run_check("ex-7-hook", launch_blocking)
    assert not result.passed and "async_op=True" in result.message
    result = run_check("ex-7-hook", launch_sum)
    assert not result.passed and "sum of the ranks' gradients" in result.message
    result = run_check("ex-7-hook", launch_and_forget)
    assert not result.passed and "nothing was appended" in result.message
    result = run_check("ex-7-hook", divide_after_launching)
    assert not result.passed and "changed in place after their all-reduce" in result.message


# --------------------------------------------------------------------------- sampler
def sampler_reference(n, world, rank, epoch, seed):
    s = DistributedSampler(range(n), num_replicas=world, rank=rank, seed=seed)
    s.set_epoch(epoch)
    return list(s)


def sampler_without_epoch(n, world, rank, epoch, seed):
    return sampler_reference(n, world, rank, 0, seed)


def sampler_contiguous(n, world, rank, epoch, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    size = -(-n // world)
    perm += (perm * world)[: size * world - n]
    return perm[rank * size : (rank + 1) * size]


def sampler_unpadded(n, world, rank, epoch, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return perm[rank::world]


def test_sampler_check():
    assert run_check("ex-7-sampler", sampler_reference).passed
    assert run_check("ex-7-sampler", lambda *a: ddp.epoch_indices(*a)).passed
    result = run_check("ex-7-sampler", sampler_without_epoch)
    assert not result.passed and "epoch 0's order again" in result.message
    result = run_check("ex-7-sampler", sampler_contiguous)
    assert not result.passed and "deals it out like cards" in result.message
    result = run_check("ex-7-sampler", sampler_unpadded)
    assert not result.passed and "padded by repeating" in result.message


# --------------------------------------------------------------------------- step 2
def average_sum(module):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def average_touching_frozen(module):
    for p in module.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)


def average_nothing(module):
    pass


def test_average_check(short_timeouts, pools):
    assert run_check("ex-7-average", ddp.all_reduce_gradients).passed
    result = run_check("ex-7-average", average_sum)
    assert not result.passed and "sum of the ranks' gradients" in result.message
    result = run_check("ex-7-average", average_touching_frozen)
    assert not result.passed and "frozen fc1.bias" in result.message
    result = run_check("ex-7-average", average_nothing)
    assert not result.passed and "did not change" in result.message
