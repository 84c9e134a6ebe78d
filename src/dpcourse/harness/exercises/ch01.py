"""Checks for chapter 1's exercises (training on one device).

Chapter 1: training on one device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dpcourse.harness.exercises.core import (
    Mismatch,
    about,
    call_learner,
    call_learner_untouched,
    exercise,
    expect_type,
)
from dpcourse.one_device import memory, memory_measurement, models

PARTS = ("parameters", "gradients", "optimizer_state", "activations")


@exercise("ex-1-batch", function="growth_when_batch_doubles")
def batch_growth(answer: Callable[[], dict]) -> str:
    """``answer()`` returns the factor by which each part of training memory grows when the
    batch doubles, e.g. ``{"parameters": 1, ...}``; compared with a measurement."""
    factors = call_learner(answer)
    if not isinstance(factors, dict) or set(factors) != set(PARTS):
        raise Mismatch(f"expected a dict with the keys {list(PARTS)}, got {factors!r}")
    for part in PARTS:
        expect_type(factors[part], (int, float), f"the factor of {part}",
                    "Give each factor as a number, such as 1 or 2")
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
    :func:`dpcourse.one_device.memory.max_batch_size`, for two MLPs (one in float64) and budgets
    from tight to roomy, with each optimizer the estimate knows and with the default; the model
    and the sample must come back untouched, and the answer must be an int."""
    cases = []
    for hidden, dtype in ((32, torch.float32), (128, torch.float64)):
        torch.manual_seed(0)
        model = models.MLP(hidden=hidden).to(dtype)
        sample = torch.randn(1, 5, dtype=dtype)
        one = memory.estimate_training_memory(model, sample, "adam")
        fixed = one.parameters + one.gradients + one.optimizer_state
        for budget in (
            fixed - 1,
            fixed + one.activations - 1,
            fixed + one.activations,
            fixed + 7 * one.activations + 3,
            2**20,
        ):
            cases.append((hidden, dtype, model, sample, budget, "adam"))
        for optimizer in ("sgd", "sgd_momentum", None):  # None: the default, not passed
            cases.append((hidden, dtype, model, sample, fixed + 7 * one.activations, optimizer))
    for hidden, dtype, model, sample, budget, optimizer in cases:
        name = optimizer or "adam"
        want = memory.max_batch_size(model, sample, budget, name)
        args = (model, sample, budget) + ((optimizer,) if optimizer else ())
        what = (f"MLP(hidden={hidden}) in {str(dtype).removeprefix('torch.')}, "
                + (f"optimizer={optimizer!r}" if optimizer else "the default optimizer")
                + f", a budget of {budget:,} bytes")
        with about(what):
            got = call_learner_untouched(fn, ["model", "sample"], *args)
            expect_type(got, int, "the batch size",
                        "A batch holds a whole number of samples: use // rather than /")
        if got != want:
            one = memory.estimate_training_memory(model, sample, name)
            fixed = one.parameters + one.gradients + one.optimizer_state
            hint = ""
            if got > want:
                hint = (
                    f" (an estimate at batch {got} needs {fixed + got * one.activations:,} "
                    f"bytes, over the budget)"
                )
            if name != "adam" and got == memory.max_batch_size(model, sample, budget, "adam"):
                hint += (f". That is the answer for Adam: pass `optimizer` on to "
                         f"estimate_training_memory ({name!r} keeps less state)")
            raise Mismatch(
                f"{what} (fixed part {fixed:,} bytes, {one.activations:,} bytes of activations "
                f"per sample): expected {want}, got {got!r}{hint}"
            )
    return (f"right on {len(cases)} budgets, with every optimizer and in float32 and float64, "
            "including budgets where not even a batch of 1 fits")
