"""The scaling model, the measured DDP points and the gradient noise scale (chapter 10)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpcourse import costmodel, data, models, scaling, simulate
from dpcourse.launch import run_ranks

# A 1.3B-parameter model in bf16, 32k tokens per GPU per step, on H100s over InfiniBand NDR.
P = 1.3e9
COMPUTE = scaling.compute_time(P, 32768, scaling.H100, mfu=0.4)
GRAD = scaling.gradient_bytes(P, "bf16")
NET = dict(alpha=scaling.IB_NDR.alpha, beta=scaling.IB_NDR.beta)
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
        one = scaling.all_reduce_time(GRAD, n, **NET)
        assert one == pytest.approx(costmodel.predict("ring", n, GRAD, **NET))
        ten = scaling.all_reduce_time(GRAD, n, **NET, buckets=10)
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
        assert sim == pytest.approx(scaling.all_reduce_time(GRAD, n, **NET), rel=1e-9)


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
        comm = scaling.all_reduce_time(GRAD, n, **NET)
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
        scaling.all_reduce_time(1.0, 2, 1e-6, 1e9, buckets=0)


def test_hierarchical_all_reduce_reduces_to_flat_rings_at_the_extremes():
    intra, inter = scaling.NVLINK4, scaling.IB_NDR
    for n in (1, 2, 8):  # one node
        t = scaling.hierarchical_all_reduce_time(GRAD, n, 8, intra, inter)
        assert t == pytest.approx(scaling.all_reduce_time(GRAD, n, intra.alpha, intra.beta))
    for n in (2, 16, 64):  # one GPU per node
        t = scaling.hierarchical_all_reduce_time(GRAD, n, 1, intra, inter)
        assert t == pytest.approx(scaling.all_reduce_time(GRAD, n, inter.alpha, inter.beta))
    # across nodes it beats a flat ring at the slowest link's speed, by about g
    flat = scaling.all_reduce_time(GRAD, 64, inter.alpha, inter.beta)
    two_level = scaling.hierarchical_all_reduce_time(GRAD, 64, 8, intra, inter)
    assert flat / 8 < two_level < flat / 4
    with pytest.raises(ValueError, match="multiple"):
        scaling.hierarchical_all_reduce_time(GRAD, 12, 8)


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


# ------------------------------------------------------------------------ measured points
def test_ddp_step_times_on_two_ranks():
    results = run_ranks(
        scaling.ddp_step_times_on_rank, 2, [8, 32], hidden=64, steps=3, warmup=1,
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
        scaling.ddp_step_times_on_rank, 1, [4], hidden=16, steps=2, warmup=1, timeout=120
    )
    assert r["world_size"] == 1 and r["comm"] == [0.0] * len(r["comm_sizes"])


@pytest.mark.gpu
def test_ddp_step_times_run_on_the_gpu():
    (r,) = run_ranks(
        scaling.ddp_step_times_on_rank, 1, [8], hidden=64, steps=2, warmup=1, timeout=120
    )
    assert r["device"].startswith("cuda") and all(t > 0 for t in r["compute"] + r["ddp"])


@pytest.mark.multigpu
def test_ddp_step_times_on_two_gpus_with_nccl():
    results = run_ranks(
        scaling.ddp_step_times_on_rank, 2, [8], hidden=64, steps=2, warmup=1,
        comm_sizes=(2**10, 2**20), comm_repeats=3, timeout=120,
    )  # fmt: skip
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]  # one GPU per rank
    assert results[0]["ddp"] == results[1]["ddp"] and all(t > 0 for t in results[0]["comm"])


# ----------------------------------------------------------------- the gradient noise scale
def _gaussian_norms(trials, g, sigma_diag, b, rng):
    """Squared norms of mean gradients of b examples drawn from N(g, diag(sigma_diag))."""
    noise = rng.standard_normal((trials, g.size)) * np.sqrt(sigma_diag / b)
    return ((g + noise) ** 2).sum(1)


def test_noise_scale_estimator_is_unbiased_on_gaussian_gradients():
    rng = np.random.default_rng(0)
    dim, trials, b_small, b_big = 50, 20000, 4, 64
    g = rng.standard_normal(dim) * 0.3
    sigma = rng.uniform(0.5, 2.0, dim)  # a known diagonal covariance per example
    true_g2, true_trace = float(g @ g), float(sigma.sum())
    small = _gaussian_norms(trials, g, sigma, b_small, rng)
    big = _gaussian_norms(trials, g, sigma, b_big, rng)
    per_trial = [
        scaling.noise_scale_from_norms(s, b, b_small, b_big)
        for s, b in zip(small, big, strict=True)
    ]
    g2 = np.array([e.g2 for e in per_trial])
    tr = np.array([e.trace for e in per_trial])
    # the mean of single-pair estimates is within 4 standard errors of the truth ...
    assert abs(g2.mean() - true_g2) < 4 * g2.std() / math.sqrt(trials)
    assert abs(tr.mean() - true_trace) < 4 * tr.std() / math.sqrt(trials)
    # ... while the naive estimate |G_big|^2 of |G|^2 is biased by tr/b_big, and this test sees it
    assert abs(big.mean() - true_g2) > 20 * big.std() / math.sqrt(trials)
    pooled = scaling.noise_scale_from_norms(small.mean(), big.mean(), b_small, b_big)
    assert pooled.b_simple == pytest.approx(true_trace / true_g2, rel=0.05)
    with pytest.raises(ValueError, match="b_small"):
        scaling.noise_scale_from_norms(1.0, 1.0, 8, 8)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second intra-op thread only adds waiting, badly so on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def regression():
    x, y = data.random_regression(num_samples=400, seed=1).tensors
    torch.manual_seed(0)
    return models.MLP(), x, y


def test_exact_noise_scale_matches_a_loop_over_examples(regression):
    model, x, y = regression
    exact = scaling.exact_noise_scale(model, x[:20], y[:20])
    grads = []
    for i in range(20):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    grads = torch.stack(grads)
    mean = grads.mean(0)
    assert exact.g2 == pytest.approx(float(mean @ mean), rel=1e-6)
    assert exact.trace == pytest.approx(float((grads - mean).square().sum(1).mean()), rel=1e-6)


def test_two_batch_estimate_of_a_real_model_is_close_to_the_exact_value(regression):
    model, x, y = regression
    exact = scaling.exact_noise_scale(model, x, y)
    est = scaling.measure_noise_scale(model, x, y, b_small=4, b_big=64, repeats=500, seed=3)
    # within 4 standard errors, and those are small enough to mean something
    assert abs(est.g2 - exact.g2) < 4 * est.g2_stderr < 0.2 * exact.g2
    assert abs(est.trace - exact.trace) < 4 * est.trace_stderr < 0.4 * exact.trace
    # the pooled estimate is the mean of the single pairs' (the estimators are linear)
    again = scaling.measure_noise_scale(model, x, y, b_small=4, b_big=64, repeats=1, seed=3)
    assert math.isnan(again.g2_stderr)


# ------------------------------------------------------------ steps to a target, trade-off
def test_fit_recovers_s_min_and_b_crit_and_the_points_lie_on_the_tradeoff_curve():
    b = np.array([1, 2, 4, 8, 16, 64, 256], dtype=float)
    s_min, b_crit = 120.0, 13.0
    steps = s_min * (1 + b_crit / b)
    got_s, got_e, got_b = scaling.fit_steps_to_target(b, steps)
    assert (got_s, got_e, got_b) == pytest.approx((s_min, s_min * b_crit, b_crit))
    ratio_s, ratio_e = steps / s_min, b * steps / (s_min * b_crit)
    assert scaling.tradeoff_examples(ratio_s) == pytest.approx(ratio_e)
    assert np.allclose((ratio_s - 1) * (ratio_e - 1), 1.0)
    with pytest.raises(ValueError, match="greater than 1"):
        scaling.tradeoff_examples([1.0])
    with pytest.raises(ValueError, match="two"):
        scaling.fit_steps_to_target([1], [2])


def test_steps_to_target_reaches_the_target_or_says_none(regression):
    _, x, y = regression
    steps = scaling.steps_to_target(models.MLP, x, y, 32, 0.2, 0.1, max_steps=1000)
    assert steps is not None and steps % 5 == 0
    assert scaling.steps_to_target(models.MLP, x, y, 32, 0.2, 0.0, max_steps=50) is None
    assert scaling.steps_to_target(models.MLP, x, y, 32, 1e3, 0.1, max_steps=200) is None


def test_best_steps_to_target_finds_the_brute_force_minimum(regression):
    _, x, y = regression
    lrs = [0.05, 0.1, 0.2, 0.4]
    brute = {lr: scaling.steps_to_target(models.MLP, x, y, 16, lr, 0.1, 1000) for lr in lrs}
    want = min(s for s in brute.values() if s is not None)
    steps, lr = scaling.best_steps_to_target(models.MLP, x, y, 16, lrs, 0.1, 1000)
    assert steps == want and brute[lr] == want
    assert scaling.best_steps_to_target(models.MLP, x, y, 16, lrs, 0.0, 20) == (None, None)
