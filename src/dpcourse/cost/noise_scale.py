"""Large-batch limits: the gradient noise scale and steps to a target (McCandlish et al., 2018).

The gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` from gradients of two batch sizes (the
paper's appendix A.1), exactly from per-example gradients on a small data set, steps-to-target
against batch size, and the steps/examples trade-off ``(S/S_min - 1)(E/E_min - 1) = 1``. Tested
in ``tests/test_noise_scale.py``.

Chapter 10: the gradient noise scale and the critical batch size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

__all__ = [
    "NoiseScale",
    "noise_scale_from_norms",
    "measure_noise_scale",
    "exact_noise_scale",
    "steps_to_target",
    "best_steps_to_target",
    "fit_steps_to_target",
    "tradeoff_examples",
]


# ----------------------------------------------------------------- the gradient noise scale


@dataclass(frozen=True)
class NoiseScale:
    """Estimates of ``|G|^2`` (the squared norm of the true gradient) and ``tr(Sigma)`` (the
    trace of the per-example gradient covariance); ``b_simple = tr(Sigma) / |G|^2`` is
    McCandlish et al.'s simple noise scale, an estimate of the critical batch size."""

    g2: float
    trace: float
    g2_stderr: float = math.nan  # standard errors, where several pairs were averaged
    trace_stderr: float = math.nan

    @property
    def b_simple(self) -> float:
        return self.trace / self.g2


def noise_scale_from_norms(
    g_small_sq: float, g_big_sq: float, b_small: float, b_big: float
) -> NoiseScale:
    """Unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from the squared norms of two gradient
    estimates, averaged over ``b_small`` and ``b_big`` examples (McCandlish et al., 2018,
    appendix A.1). Both follow from ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``::
        |G|^2     = (b_big |G_big|^2 - b_small |G_small|^2) / (b_big - b_small)
        tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1/b_small - 1/b_big)

    In data-parallel training both come for free: a rank's local gradient (b_small) and the
    all-reduced one (b_big = N * b_small). Their ratio is a biased estimate of B_simple; the
    paper averages the numerator and denominator over many steps before dividing.
    """
    if not b_big > b_small > 0:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    g2 = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return NoiseScale(float(g2), float(trace))


def _loss_fn_default(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _flat_grad(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads])


def measure_noise_scale(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    b_small: int,
    b_big: int,
    repeats: int = 50,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn_default,
    seed: int = 0,
) -> NoiseScale:
    """The two-batch-size estimate of the noise scale at ``model``'s current parameters:
    ``repeats`` times, draw a batch of ``b_small`` and one of ``b_big`` examples (with
    replacement, so that the data set is the distribution and the estimates are unbiased),
    compute the squared gradient norms, average them, then apply
    :func:`noise_scale_from_norms`. ``loss_fn`` must average over the batch (the mean gradient).
    ``inputs``/``targets``: the whole data set, first dimension the examples. The standard
    errors come from the spread of the single-pair estimates."""
    g = torch.Generator().manual_seed(seed)
    n = len(inputs)
    small, big = [], []
    for _ in range(repeats):
        for b, acc in ((b_small, small), (b_big, big)):
            idx = torch.randint(0, n, (b,), generator=g)
            grad = _flat_grad(model, loss_fn(model(inputs[idx]), targets[idx]))
            acc.append(float(grad.double().square().sum()))
    pooled = noise_scale_from_norms(float(np.mean(small)), float(np.mean(big)), b_small, b_big)
    if repeats < 2:
        return pooled
    # The estimators are linear in the norms: the pooled one is the mean of the single pairs'.
    pairs = [noise_scale_from_norms(s, b, b_small, b_big) for s, b in zip(small, big, strict=True)]
    return NoiseScale(
        pooled.g2,
        pooled.trace,
        float(np.std([p.g2 for p in pairs], ddof=1)) / math.sqrt(repeats),
        float(np.std([p.trace for p in pairs], ddof=1)) / math.sqrt(repeats),
    )


def exact_noise_scale(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn_default,
) -> NoiseScale:
    """``|G|^2`` and ``tr(Sigma)`` computed exactly from every per-example gradient of a small
    data set (``torch.func.vmap`` over examples): ``G`` is their mean and ``Sigma`` their
    covariance (dividing by n, the data set being the whole distribution). The truth that
    :func:`measure_noise_scale` estimates."""

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one_loss(p, x, y):
        return loss_fn(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, inputs, targets)
    flat = torch.cat([g.reshape(len(inputs), -1) for g in per_example.values()], dim=1).double()
    mean = flat.mean(0)
    trace = (flat - mean).square().sum(1).mean()
    return NoiseScale(float(mean.square().sum()), float(trace))


# ------------------------------------------------------------ steps to a target, the trade-off


def steps_to_target(
    make_model: Callable[[], nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batch_size: int,
    lr: float,
    target_loss: float,
    max_steps: int = 2000,
    eval_every: int = 5,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _loss_fn_default,
    seed: int = 0,
) -> int | None:
    """Steps of plain SGD (batches drawn with replacement) until the loss on the whole data set
    is at most ``target_loss``, checked every ``eval_every`` steps; None if ``max_steps`` are
    not enough (or the loss diverges). The model starts from ``make_model()`` every time."""
    torch.manual_seed(seed)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1)
    n = len(inputs)
    for step in range(1, max_steps + 1):
        idx = torch.randint(0, n, (batch_size,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(inputs[idx]), targets[idx]).backward()
        opt.step()
        if step % eval_every == 0:
            with torch.no_grad():
                full = float(loss_fn(model(inputs), targets))
            if not math.isfinite(full) or full > 1e6:  # diverged
                return None
            if full <= target_loss:
                return step
    return None


def best_steps_to_target(
    make_model: Callable[[], nn.Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batch_size: int,
    lrs: Sequence[float],
    target_loss: float,
    max_steps: int = 2000,
    start_lr: float | None = None,
    **kwargs,
) -> tuple[int | None, float | None]:
    """The fewest steps to ``target_loss`` over the learning rates ``lrs``, as McCandlish et al.
    and Shallue et al. tune the learning rate for every batch size. Returns ``(steps, lr)``, or
    ``(None, None)`` if no learning rate reaches the target within ``max_steps``.

    To stay cheap it assumes steps are unimodal in the learning rate: it starts at ``start_lr``
    (default: the middle of the sorted ``lrs``; pass the best rate of the next smaller batch),
    walks up while the steps fall, then down, and stops every run once it needs more steps than
    the best so far."""
    lrs = sorted(lrs)
    if not lrs:
        raise ValueError("lrs must hold at least one learning rate")
    best: tuple[int | None, float | None] = (None, None)

    def attempt(lr: float) -> bool:
        nonlocal best
        limit = max_steps if best[0] is None else best[0] - 1
        s = steps_to_target(
            make_model, inputs, targets, batch_size, lr, target_loss, limit, **kwargs
        )
        if s is not None:
            best = (s, lr)
        return s is not None

    middle = len(lrs) // 2 if start_lr is None else lrs.index(start_lr)
    attempt(lrs[middle])
    for lr in lrs[middle + 1 :]:  # larger rates while they help
        if not attempt(lr) and best[0] is not None:
            break
    for lr in reversed(lrs[:middle]):  # then smaller ones
        if not attempt(lr) and best[0] is not None:
            break
    return best


def fit_steps_to_target(
    batch_sizes: Sequence[float], steps: Sequence[float]
) -> tuple[float, float, float]:
    """Fit McCandlish et al.'s ``S = S_min (1 + B_crit / B)`` to measured (batch size, steps):
    linear least squares of ``S = S_min + E_min / B`` weighted by 1/S (relative error). Returns
    ``(S_min, E_min, B_crit)`` with ``E_min = S_min * B_crit`` the fewest examples."""
    b = np.asarray(batch_sizes, dtype=float)
    s = np.asarray(steps, dtype=float)
    if b.shape != s.shape or b.size < 2:
        raise ValueError("need at least two (batch size, steps) pairs of the same length")
    design = np.stack([np.ones_like(b), 1.0 / b], axis=1) / s[:, None]
    (s_min, e_min), *_ = np.linalg.lstsq(design, np.ones_like(s), rcond=None)
    return float(s_min), float(e_min), float(e_min / s_min)


def tradeoff_examples(steps_ratio):
    """``E/E_min`` on the curve ``(S/S_min - 1)(E/E_min - 1) = 1`` for ``S/S_min`` > 1 (a number
    or an array): the fewer the steps, the more examples it takes."""
    r = np.asarray(steps_ratio, dtype=float)
    if np.any(r <= 1):
        raise ValueError("S/S_min must be greater than 1: no batch size needs fewer than S_min")
    return 1.0 + 1.0 / (r - 1.0)
