"""Checks for chapter 1's exercises (training on one device).

Chapter 1: training on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dpcourse.harness.exercises.core import Mismatch, call_learner, exercise
from dpcourse.one_device import memory, memory_measurement, models

PARTS = ("parameters", "gradients", "optimizer_state", "activations")


@exercise("ex-1-batch", function="growth_when_batch_doubles")
def batch_growth(answer: Callable[[], dict]) -> str:
    """``answer()`` returns the factor by which each part of training memory grows when the
    batch doubles, e.g. ``{"parameters": 1, ...}``; compared with a measurement."""
    factors = call_learner(answer)
    if not isinstance(factors, dict) or set(factors) != set(PARTS):
        raise Mismatch(f"expected a dict with the keys {list(PARTS)}, got {factors!r}")
    torch.manual_seed(0)
    model = models.MLP()
    # Fresh tensors for each batch: a slice would count the memory of the whole tensor.
    small, large = (
        memory_measurement.measure_training_memory(
            model,
            (torch.randn(b, 5), torch.randn(b, 2)),
            nn.MSELoss(),
            torch.optim.Adam(model.parameters()),
        )
        for b in (30, 60)
    )
    for part in PARTS:
        measured = getattr(large, part) / getattr(small, part)
        if abs(float(factors[part]) - measured) > 0.05 * measured:
            raise Mismatch(
                f"{part}: you said it grows by a factor of {factors[part]}, but measured on the "
                f"MLP with Adam (batch 30 -> 60) it grows by {measured:.2f}"
            )
    return "only the activations grow with the batch (x2); the rest stays the same"


@exercise("ex-1-max-batch", function="my_max_batch_size")
def max_batch_size(fn: Callable) -> str:
    """``fn(model, sample, gpu_memory_bytes, optimizer="adam")`` against
    :func:`dpcourse.one_device.memory.max_batch_size`, for two MLPs and budgets from tight to
    roomy."""
    cases = []
    for hidden in (32, 128):
        torch.manual_seed(0)
        model, sample = models.MLP(hidden=hidden), torch.randn(1, 5)
        one = memory.estimate_training_memory(model, sample, "adam")
        fixed = one.parameters + one.gradients + one.optimizer_state
        for budget in (
            fixed - 1,
            fixed + one.activations - 1,
            fixed + one.activations,
            fixed + 7 * one.activations + 3,
            2**20,
        ):
            cases.append((hidden, model, sample, budget))
    for hidden, model, sample, budget in cases:
        want = memory.max_batch_size(model, sample, budget, "adam")
        got = call_learner(fn, model, sample, budget, "adam")
        if got != want:
            one = memory.estimate_training_memory(model, sample, "adam")
            fixed = one.parameters + one.gradients + one.optimizer_state
            hint = ""
            if isinstance(got, int) and got > want:
                hint = (
                    f" (an estimate at batch {got} needs {fixed + got * one.activations:,} "
                    f"bytes, over the budget)"
                )
            raise Mismatch(
                f"MLP(hidden={hidden}) with a budget of {budget:,} bytes (fixed part "
                f"{fixed:,} bytes, {one.activations:,} bytes of activations per sample): "
                f"expected {want}, got {got!r}{hint}"
            )
    return f"right on {len(cases)} budgets, including ones where not even a batch of 1 fits"
