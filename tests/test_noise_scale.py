"""The gradient noise scale, steps to a target and the trade-off (chapter 10)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpcourse.cost import noise_scale
from dpcourse.one_device import data, models


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
        noise_scale.noise_scale_from_norms(s, b, b_small, b_big)
        for s, b in zip(small, big, strict=True)
    ]
    g2 = np.array([e.g2 for e in per_trial])
    tr = np.array([e.trace for e in per_trial])
    # the mean of single-pair estimates is within 4 standard errors of the truth ...
    assert abs(g2.mean() - true_g2) < 4 * g2.std() / math.sqrt(trials)
    assert abs(tr.mean() - true_trace) < 4 * tr.std() / math.sqrt(trials)
    # ... while the naive estimate |G_big|^2 of |G|^2 is biased by tr/b_big, and this test sees it
    assert abs(big.mean() - true_g2) > 20 * big.std() / math.sqrt(trials)
    pooled = noise_scale.noise_scale_from_norms(small.mean(), big.mean(), b_small, b_big)
    assert pooled.b_simple == pytest.approx(true_trace / true_g2, rel=0.05)
    with pytest.raises(ValueError, match="b_small"):
        noise_scale.noise_scale_from_norms(1.0, 1.0, 8, 8)


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
    exact = noise_scale.exact_noise_scale(model, x[:20], y[:20])
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
    exact = noise_scale.exact_noise_scale(model, x, y)
    est = noise_scale.measure_noise_scale(model, x, y, b_small=4, b_big=64, repeats=500, seed=3)
    # within 4 standard errors, and those are small enough to mean something
    assert abs(est.g2 - exact.g2) < 4 * est.g2_stderr < 0.2 * exact.g2
    assert abs(est.trace - exact.trace) < 4 * est.trace_stderr < 0.4 * exact.trace
    # the pooled estimate is the mean of the single pairs' (the estimators are linear)
    again = noise_scale.measure_noise_scale(model, x, y, b_small=4, b_big=64, repeats=1, seed=3)
    assert math.isnan(again.g2_stderr)


# ------------------------------------------------------------ steps to a target, trade-off
def test_fit_recovers_s_min_and_b_crit_and_the_points_lie_on_the_tradeoff_curve():
    b = np.array([1, 2, 4, 8, 16, 64, 256], dtype=float)
    s_min, b_crit = 120.0, 13.0
    steps = s_min * (1 + b_crit / b)
    got_s, got_e, got_b = noise_scale.fit_steps_to_target(b, steps)
    assert (got_s, got_e, got_b) == pytest.approx((s_min, s_min * b_crit, b_crit))
    ratio_s, ratio_e = steps / s_min, b * steps / (s_min * b_crit)
    assert noise_scale.tradeoff_examples(ratio_s) == pytest.approx(ratio_e)
    assert np.allclose((ratio_s - 1) * (ratio_e - 1), 1.0)
    with pytest.raises(ValueError, match="greater than 1"):
        noise_scale.tradeoff_examples([1.0])
    with pytest.raises(ValueError, match="two"):
        noise_scale.fit_steps_to_target([1], [2])


def test_steps_to_target_reaches_the_target_or_says_none(regression):
    _, x, y = regression
    steps = noise_scale.steps_to_target(models.MLP, x, y, 32, 0.2, 0.1, max_steps=1000)
    assert steps is not None and steps % 5 == 0
    assert noise_scale.steps_to_target(models.MLP, x, y, 32, 0.2, 0.0, max_steps=50) is None
    assert noise_scale.steps_to_target(models.MLP, x, y, 32, 1e3, 0.1, max_steps=200) is None


def test_best_steps_to_target_finds_the_brute_force_minimum(regression):
    _, x, y = regression
    lrs = [0.05, 0.1, 0.2, 0.4]
    brute = {lr: noise_scale.steps_to_target(models.MLP, x, y, 16, lr, 0.1, 1000) for lr in lrs}
    want = min(s for s in brute.values() if s is not None)
    steps, lr = noise_scale.best_steps_to_target(models.MLP, x, y, 16, lrs, 0.1, 1000)
    assert steps == want and brute[lr] == want
    assert noise_scale.best_steps_to_target(models.MLP, x, y, 16, lrs, 0.0, 20) == (None, None)
