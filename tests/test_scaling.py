"""The step-time model and the measured DDP points (chapter 10)."""

from __future__ import annotations

import math

import pytest
import torch

from dpcourse.cost import costmodel, hardware, scaling, simulate
from dpcourse.harness.bench import scaling as bench_scaling
from dpcourse.harness.launch import run_ranks
from dpcourse.one_device import models

# A 1.3B-parameter model in bf16, 32k tokens per GPU per step, on H100s over InfiniBand NDR.
P = 1.3e9
COMPUTE = scaling.compute_time(P, 32768, hardware.H100, mfu=0.4)
GRAD = scaling.gradient_bytes(P, "bf16")
NET = dict(alpha=hardware.IB_NDR.alpha, beta=hardware.IB_NDR.beta)
WORLDS = [1, 2, 3, 4, 8, 16, 64, 256, 1024, 8192, 65536]
SETTINGS = [
    dict(compute_s=COMPUTE, grad_bytes=GRAD, **NET),
    dict(compute_s=COMPUTE, grad_bytes=GRAD, **NET, overlap=2 / 3, buckets=100),
    dict(compute_s=1e-3, grad_bytes=4e8, alpha=20e-6, beta=1e9, overlap=1.0, buckets=3),
    dict(compute_s=0.05, grad_bytes=1e6, alpha=1e-4, beta=1e10),  # latency-bound
]


# ----------------------------------------------------------------------------- the model
def test_compute_time_is_six_params_tokens_over_achieved_flops():
    assert scaling.training_flops(1e9, 1000) == 6e12
    assert COMPUTE == pytest.approx(6 * 1.3e9 * 32768 / (989e12 * 0.4))
    assert 0.6 < COMPUTE < 0.7  # 0.65 s
    with pytest.raises(ValueError, match="mfu"):
        scaling.compute_time(P, 1, mfu=40)


def test_gradient_bytes_per_dtype():
    assert scaling.gradient_bytes(10, "bf16") == 20 == scaling.gradient_bytes(10, torch.bfloat16)
    assert scaling.gradient_bytes(10, "fp32") == 40 == scaling.gradient_bytes(10, torch.float32)
    with pytest.raises(ValueError, match="dtype"):
        scaling.gradient_bytes(10, "int3")


def test_all_reduce_time_is_chapter_six_ring_with_a_latency_per_bucket():
    for n in (1, 2, 5, 64):
        one = costmodel.all_reduce_time("ring", n, GRAD, **NET)
        a, b = costmodel.terms("ring", n)
        assert one == pytest.approx(a * NET["alpha"] + b * GRAD / NET["beta"])
        ten = costmodel.all_reduce_time("ring", n, GRAD, **NET, buckets=10)
        assert ten - one == pytest.approx(9 * 2 * (n - 1) * NET["alpha"])
    assert scaling.bucket_count(GRAD) == math.ceil(2.6e9 / (25 * 2**20)) == 100
    assert scaling.bucket_count(1.0) == 1
    # PyTorch's DDP: a first bucket of 1 MiB, then 25 MiB ones
    assert scaling.bucket_count(1.19e6, first_bucket_bytes=2**20) == 2
    assert scaling.bucket_count(1e5, first_bucket_bytes=2**20) == 1
    assert scaling.bucket_count(2**20 + 25 * 2**20, first_bucket_bytes=2**20) == 2
    with pytest.raises(ValueError, match="positive"):
        scaling.bucket_count(1.0, 0)


def test_simulated_ring_agrees_with_the_model():
    for n in (2, 4, 8):
        sim = simulate.all_reduce_time("ring", n, GRAD, **NET)
        assert sim == pytest.approx(costmodel.all_reduce_time("ring", n, GRAD, **NET), rel=1e-9)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("mode", ["weak", "strong"])
def test_efficiency_is_one_on_one_rank_and_never_grows_with_n(setting, mode):
    eff = [scaling.efficiency(n, **setting, mode=mode) for n in WORLDS]
    assert eff[0] == 1.0
    assert all(0 < e <= 1 for e in eff)
    assert all(b <= a + 1e-12 for a, b in zip(eff, eff[1:], strict=False)), eff


def test_efficiency_limits():
    for n in WORLDS:
        for mode in ("weak", "strong"):
            # no latency and infinite bandwidth: communication is free
            e = scaling.efficiency(n, COMPUTE, GRAD, 0.0, math.inf, mode=mode)
            assert e == 1.0
            # alpha -> 0 and beta -> infinity: the efficiency climbs to 1
            gaps = [
                1
                - scaling.efficiency(n, COMPUTE, GRAD, NET["alpha"] / k, NET["beta"] * k, mode=mode)
                for k in (1e3, 1e5, 1e7)
            ]
            if n == 1:
                assert gaps == [0.0, 0.0, 0.0]
            else:
                assert gaps[0] > gaps[1] > gaps[2] > 0 and gaps[2] <= gaps[1] / 50
        # full overlap: perfect scaling while the all-reduce fits behind the compute
        comm = costmodel.all_reduce_time("ring", n, GRAD, **NET)
        full = scaling.step_time(n, COMPUTE, GRAD, **NET, overlap=1.0)
        assert full == pytest.approx(max(COMPUTE, comm))
        assert scaling.step_time(n, COMPUTE, GRAD, **NET) == pytest.approx(COMPUTE + comm)
    assert scaling.efficiency(64, COMPUTE, GRAD, **NET, overlap=1.0) == 1.0
    assert scaling.overlapped_step_time(1.0, 0.5, 2 / 3) == 1.0
    assert scaling.overlapped_step_time(1.0, 0.9, 2 / 3) == pytest.approx(0.9 + 1 / 3)
    assert scaling.overlapped_step_time(1.0, 0.9) == pytest.approx(1.9)


def test_overlap_bytes_and_buckets_move_the_efficiency_the_expected_way():
    n = 256
    base = scaling.efficiency(n, COMPUTE, GRAD, **NET)
    assert scaling.efficiency(n, COMPUTE, GRAD, **NET, overlap=2 / 3) > base
    fp32 = scaling.efficiency(n, COMPUTE, scaling.gradient_bytes(P, "fp32"), **NET)
    assert fp32 < base
    assert scaling.efficiency(n, COMPUTE, GRAD, **NET, buckets=1000) < base
    assert scaling.efficiency(n, COMPUTE, GRAD, **NET, mode="strong") < base


def test_step_time_refuses_bad_input():
    with pytest.raises(ValueError, match="overlap"):
        scaling.step_time(2, 1.0, 1.0, 1e-6, 1e9, overlap=1.5)
    with pytest.raises(ValueError, match="world_size"):
        scaling.step_time(0, 1.0, 1.0, 1e-6, 1e9)
    with pytest.raises(ValueError, match="mode"):
        scaling.efficiency(2, 1.0, 1.0, 1e-6, 1e9, mode="medium")
    with pytest.raises(ValueError, match="buckets"):
        costmodel.all_reduce_time("ring", 2, 1.0, 1e-6, 1e9, buckets=0)


def test_hierarchical_all_reduce_reduces_to_flat_rings_at_the_extremes():
    intra, inter = hardware.NVLINK4, hardware.IB_NDR
    for n in (1, 2, 8):  # one node
        t = scaling.hierarchical_all_reduce_time(GRAD, n, 8, intra, inter)
        flat = costmodel.all_reduce_time("ring", n, GRAD, intra.alpha, intra.beta)
        assert t == pytest.approx(flat)
    for n in (2, 16, 64):  # one GPU per node
        t = scaling.hierarchical_all_reduce_time(GRAD, n, 1, intra, inter)
        flat = costmodel.all_reduce_time("ring", n, GRAD, inter.alpha, inter.beta)
        assert t == pytest.approx(flat)
    # across nodes it beats one flat ring through one card (the pessimistic bound) by about g,
    # but not a ring per card, which puts 1/g of the data on each card too: the model runs
    # the two-level all-reduce's NVLink phases after the cross-node one, not beside it
    flat = costmodel.all_reduce_time("ring", 64, GRAD, inter.alpha, inter.beta)
    two_level = scaling.hierarchical_all_reduce_time(GRAD, 64, 8, intra, inter)
    assert flat / 8 < two_level < flat / 4
    assert scaling.flat_all_reduce_time(GRAD, 64, rings=1) == pytest.approx(flat)
    assert scaling.flat_all_reduce_time(GRAD, 64) < two_level
    with pytest.raises(ValueError, match="multiple"):
        scaling.hierarchical_all_reduce_time(GRAD, 12, 8)


def test_flat_ring_across_nodes_runs_a_ring_per_card():
    intra, inter = hardware.NVLINK4, hardware.IB_NDR
    # 8 rings over 8 NDR cards: the node's 400 GB/s, under NVLink's 450; the latency once
    link = scaling.cross_node_link(8)
    assert (link.alpha, link.beta) == (inter.alpha, 400e9)
    assert scaling.cross_node_link(1).beta == inter.beta  # one ring, one card: the bound
    assert scaling.cross_node_link(16).beta == intra.beta  # NVLink caps what the cards add
    assert scaling.cross_node_link(8, hardware.IB_HDR, hardware.NVLINK3).beta == 200e9
    for n in (1, 2, 8):  # one node: NVLink whatever the rings
        want = costmodel.all_reduce_time("ring", n, GRAD, intra.alpha, intra.beta, 3)
        assert scaling.flat_all_reduce_time(GRAD, n, buckets=3, rings=1) == pytest.approx(want)
    for n in (16, 64, 1024):
        one = scaling.flat_all_reduce_time(GRAD, n, buckets=3, rings=1)
        eight = scaling.flat_all_reduce_time(GRAD, n, buckets=3)  # default: a ring per GPU
        latency = 3 * 2 * (n - 1) * inter.alpha
        assert (one - latency) == pytest.approx(8 * (eight - latency))  # 1/8 of the bytes
        assert eight == pytest.approx(
            costmodel.all_reduce_time("ring", n, GRAD, link.alpha, link.beta, 3))
    assert scaling.flat_all_reduce_time(GRAD, 16, 4) == pytest.approx(
        costmodel.all_reduce_time("ring", 16, GRAD, inter.alpha, 4 * inter.beta))
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="rings"):
            scaling.cross_node_link(bad)


@pytest.mark.parametrize("setting", SETTINGS)
def test_largest_world_size_agrees_with_brute_force(setting):
    for mode, target in (("weak", 0.9), ("strong", 0.5), ("weak", 0.999)):

        def eff(n, mode=mode):
            return scaling.efficiency(n, **setting, mode=mode)

        limit = 5000
        got = scaling.largest_world_size(target, eff, limit=limit)
        want = max([n for n in range(1, limit + 1) if eff(n) >= target], default=0)
        assert got == want
    assert scaling.largest_world_size(1.01, lambda n: 1.0) == 0
    assert scaling.largest_world_size(0.5, lambda n: 1.0, limit=77) == 77


def test_tokens_to_hide_is_where_the_overlapped_step_is_all_compute():
    comm = costmodel.all_reduce_time("ring", 64, GRAD, **NET)
    tokens = scaling.tokens_to_hide(comm, P, hardware.H100, mfu=0.4)
    by_hand = 2 * 63 / 64 * 2 * hardware.H100.peak_flops * 0.4 / (6 * (2 / 3) * NET["beta"])
    assert by_hand < tokens < 1.01 * by_hand  # the latencies add a little
    compute = scaling.compute_time(P, tokens, hardware.H100, mfu=0.4)
    assert math.isclose(scaling.efficiency(64, compute, GRAD, **NET, overlap=2 / 3), 1.0)
    assert scaling.efficiency(64, 0.9 * compute, GRAD, **NET, overlap=2 / 3) < 0.99
    assert scaling.tokens_to_hide(comm, P, overlap=1.0) == pytest.approx(2 / 3 * tokens)
    with pytest.raises(ValueError, match="overlap"):
        scaling.tokens_to_hide(comm, P, overlap=0.0)


# ------------------------------------------------------------------------ measured points
def test_ddp_step_times_on_two_ranks():
    results = run_ranks(
        bench_scaling.ddp_step_times_on_rank, 2, [8, 32], hidden=64, steps=3, warmup=1,
        comm_sizes=(2**10, 2**16), comm_repeats=3, timeout=120,
    )  # fmt: skip
    r = results[0]
    assert results[0] == results[1]  # the slowest rank's times, agreed on by both
    assert r["world_size"] == 2 and r["batches"] == [8, 32]
    assert r["num_params"] == sum(p.numel() for p in models.MLP(64, 64, 2).parameters())
    assert r["grad_bytes"] == 4 * r["num_params"]
    assert len(r["compute"]) == len(r["ddp"]) == 2 and len(r["comm"]) == 2
    assert all(t > 0 for t in r["compute"] + r["ddp"] + r["comm"])
    fit = costmodel.fit("ring", 2, r["comm_sizes"], r["comm"])
    assert fit.alpha >= 0 and fit.beta > 0


def test_ddp_step_times_on_one_rank_has_no_communication():
    (r,) = run_ranks(
        bench_scaling.ddp_step_times_on_rank, 1, [4], hidden=16, steps=2, warmup=1, timeout=120
    )
    assert r["world_size"] == 1 and r["comm"] == [0.0] * len(r["comm_sizes"])


@pytest.mark.gpu
def test_ddp_step_times_run_on_the_gpu():
    (r,) = run_ranks(
        bench_scaling.ddp_step_times_on_rank, 1, [8], hidden=64, steps=2, warmup=1, timeout=120
    )
    assert r["device"].startswith("cuda") and all(t > 0 for t in r["compute"] + r["ddp"])


@pytest.mark.multigpu
def test_ddp_step_times_on_two_gpus_with_nccl():
    results = run_ranks(
        bench_scaling.ddp_step_times_on_rank, 2, [8], hidden=64, steps=2, warmup=1,
        comm_sizes=(2**10, 2**20), comm_repeats=3, timeout=120,
    )  # fmt: skip
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]  # one GPU per rank
    assert results[0]["ddp"] == results[1]["ddp"] and all(t > 0 for t in results[0]["comm"])
