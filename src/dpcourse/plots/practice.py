"""Plots of chapter 8: learning-rate scaling, warm-up and float16 underflow.

Each function takes what the chapter has already computed (the
:class:`~dpcourse.practice.lr_schedule.
LargeBatchRun` results of :func:`~dpcourse.practice.lr_schedule.large_batch_run`, learning rates
from
:func:`~dpcourse.practice.lr_schedule.lr_at`, fractions from
:func:`~dpcourse.practice.mixed_precision.
underflow_fraction`), draws them on a new figure, returns the figure and never calls
``plt.show``. Nothing here trains or measures.

Chapter 8: plots of learning-rate scaling, warm-up and mixed precision.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from dpcourse.practice.lr_schedule import LargeBatchRun

__all__ = ["moving_average", "plot_scaling_rules", "plot_lr_schedules", "plot_warmup_runs",
           "plot_underflow"]


def moving_average(values: Sequence[float], window: int = 9) -> np.ndarray:
    """The mean of every ``window`` consecutive values (``len(values) - window + 1`` of them):
    what the loss curves of chapter 8 draw, so that one noisy batch does not hide the trend."""
    return np.convolve(values, np.ones(window) / window, mode="valid")


def _smoothed(ax: plt.Axes, run: LargeBatchRun, window: int, **style) -> None:
    ax.plot(run.samples[window - 1 :], moving_average(run.losses, window), **style)


def plot_scaling_rules(
    reference: LargeBatchRun, runs: Mapping[str, LargeBatchRun], window: int = 9
) -> Figure:
    """Training loss against samples seen (log scale, moving average of ``window`` steps): the
    small-batch ``reference`` in black, then one curve per scaling rule of ``runs`` (``{rule:
    run}``, all on the same larger world size), labelled with its batch and learning rate.
    Chapter 8, section 8.1."""
    fig, ax = plt.subplots(figsize=(7, 4))
    _smoothed(ax, reference, window, color="black",
              label=f"N={reference.world_size}, B={reference.samples[0]}, "
                    f"lr {reference.lrs[0]:g}")
    for rule, run in runs.items():
        _smoothed(ax, run, window,
                  label=f"N={run.world_size} (batch {run.samples[0]}), {rule} rule: "
                        f"lr {run.lrs[-1]:.3g}")
    factor = max(run.world_size for run in runs.values()) // reference.world_size
    ax.set(yscale="log", xlabel="samples seen",
           ylabel=f"training loss (moving average of {window} steps)",
           title=f"Same samples, {factor}x larger batch: which learning rate? (measured)")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def plot_lr_schedules(
    steps: Sequence[int], schedules: Mapping[str, Sequence[float]], title: str
) -> Figure:
    """The learning rate of every step, one line per schedule (``{label: rates}``, e.g. the
    values of :func:`~dpcourse.practice.lr_schedule.lr_at` with and without warm-up). Chapter 8,
    section 8.1."""
    fig, ax = plt.subplots(figsize=(6.5, 3))
    for label, rates in schedules.items():
        ax.plot(steps, rates, label=label)
    ax.set(xlabel="step", ylabel="learning rate", title=title)
    ax.legend(fontsize=9)
    ax.grid(alpha=0.3)
    return fig


def plot_warmup_runs(
    small: LargeBatchRun, runs: Sequence[LargeBatchRun], window: int = 9
) -> Figure:
    """Training loss of every step against samples seen (log scale) for large-batch ``runs``
    with and without warm-up (dots, labelled ``run.label``), against the small-batch run
    ``small`` (black, moving average of ``window`` steps). The title names the runs' world
    size, rule and final learning rate. Chapter 8, section 8.1."""
    fig, ax = plt.subplots(figsize=(7, 4))
    _smoothed(ax, small, window, color="black",
              label=f"N={small.world_size}, lr {small.lrs[0]:g} (moving average)")
    for run in runs:
        ax.plot(run.samples, run.losses, "o-", ms=3, label=run.label)
    first = runs[0]
    ax.set(yscale="log", xlabel="samples seen", ylabel="training loss",
           title=f"N={first.world_size}, {first.rule} rule (lr {first.lrs[-1]:g}): "
                 "with and without warm-up (measured)")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def plot_underflow(
    magnitudes: Sequence[float],
    zeros: Mapping[str, Sequence[float]],
    threshold: float,
) -> Figure:
    """Whether a value of each magnitude becomes 0 when cast (1 = yes; log x axis), one line per
    case of ``zeros`` (``{label: fractions}``, e.g. float16 with and without loss scaling,
    bfloat16), and a vertical line at ``threshold`` (float16's smallest subnormal, labelled as a
    power of two). Chapter 8, section 8.2."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for (label, fractions), style in zip(zeros.items(), itertools.cycle(("-", "--", ":", "-."))):
        ax.plot(magnitudes, fractions, style, lw=2, label=label)
    ax.axvline(threshold, color="grey", lw=0.8, label=f"2**{math.log2(threshold):g}")
    ax.set(xscale="log", xlabel="gradient magnitude", ylabel="becomes 0 (1 = yes)",
           title="Which gradients underflow to zero?")
    ax.legend(fontsize=9)
    return fig
