"""Plots of chapter 10: modelled and measured scaling efficiency, and the critical batch size.

Each function takes what the chapter has already computed (efficiencies from the step-time
model of :mod:`dpcourse.cost.scaling`, step times measured by
:mod:`dpcourse.harness.bench.scaling`, steps to
a target loss and their fit from :mod:`dpcourse.cost.noise_scale`), draws them on a new figure,
returns the figure and never calls ``plt.show``. Nothing here measures; the only curves computed
here are closed forms of parameters the chapter has fitted.

Chapter 10: plots of scaling efficiency and the critical batch size.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from dpcourse.cost.noise_scale import tradeoff_examples
from dpcourse.plots import algorithm_colour

__all__ = ["plot_weak_scaling", "plot_weak_vs_strong", "plot_gradient_variants",
           "plot_measured_scaling", "plot_steps_to_target", "plot_two_level"]


def _gpu_axis(ax: Axes, world_sizes: Sequence[int], target: float | None = 0.9) -> None:
    """Log x axis of GPUs labelled at every other world size, a grey line at ``target``."""
    ax.set_xscale("log")
    ticks = list(world_sizes)[::2]
    ax.set_xticks(ticks, [str(n) for n in ticks])
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8)
    ax.grid(alpha=0.3)


def plot_weak_scaling(
    world_sizes: Sequence[int],
    efficiency: Mapping[str, Mapping[tuple[str, float], Sequence[float]]],
    setting: str = "bf16, H100 at 40 % MFU",
) -> Figure:
    """Modelled weak-scaling efficiency against GPUs (log axis), one panel per model of
    ``efficiency`` (``{model: {(network view, overlap): efficiency at each world size}}``), one
    line per network view and overlap (dashed without overlap), a grey line at 90 %. Panel
    titles read "Modelled: {model} in {setting}". Chapter 10, section 10.2."""
    fig, axes = plt.subplots(1, len(efficiency), figsize=(min(8.4, 4.2 * len(efficiency)), 3.6),
                             sharey=True, layout="constrained", squeeze=False)
    for ax, (name, curves) in zip(axes[0], efficiency.items(), strict=True):
        for (network, overlap), values in curves.items():
            ax.plot(world_sizes, values, "--" if overlap == 0 else "-", marker="o", markersize=3,
                    label=f"{network}, overlap {overlap:.2f}")
        ax.set(xlabel="GPUs N", title=f"Modelled: {name} in {setting}")
        _gpu_axis(ax, world_sizes)
    axes[0, 0].set_ylabel("weak-scaling efficiency (modelled)")
    axes[0, 0].legend(fontsize=9)
    return fig


def plot_weak_vs_strong(
    world_sizes: Sequence[int],
    weak: Sequence[float],
    strong: Sequence[float],
    tokens_per_gpu: int,
    global_tokens: int,
    title: str,
) -> Figure:
    """Modelled efficiency against GPUs (log axis) of weak scaling (``tokens_per_gpu`` on every
    GPU, dots) and strong scaling (``global_tokens`` split among the GPUs, squares), a grey line
    at 90 %. Chapter 10, section 10.3."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(world_sizes, weak, "o-", label=f"weak: {tokens_per_gpu:,} tokens per GPU")
    ax.plot(world_sizes, strong, "s-", label=f"strong: {global_tokens / 1e6:.1f}M tokens in all")
    ax.set(xlabel="GPUs N", ylabel="efficiency (modelled)", title=title)
    _gpu_axis(ax, world_sizes)
    ax.legend()
    return fig


def plot_gradient_variants(
    world_sizes: Sequence[int],
    efficiency: Mapping[tuple[str, str], Sequence[float]],
    buckets: Mapping[tuple[str, str], int],
    title: str,
) -> Figure:
    """Modelled weak-scaling efficiency against GPUs (log axis), one line per gradient dtype and
    bucketing of ``efficiency`` (``{(dtype, bucketing): efficiency at each world size}``; bf16
    solid with dots, others dashed with squares), labelled with the number of buckets from
    ``buckets`` (same keys). Chapter 10, section 10.4."""
    fig, ax = plt.subplots(figsize=(6.5, 4.6), layout="constrained")
    for (dtype, label), values in efficiency.items():
        ax.plot(world_sizes, values, "o-" if dtype == "bf16" else "s--", markersize=3,
                label=f"{dtype} gradients, {label} ({buckets[dtype, label]})")
    ax.set(xlabel="GPUs N", ylabel="weak-scaling efficiency (modelled)", title=title)
    _gpu_axis(ax, world_sizes, target=None)
    fig.legend(fontsize=9, loc="outside lower center", ncols=2)  # inside, it covered curves
    return fig


def plot_measured_scaling(
    ranks: Sequence[int],
    step_s: Mapping[str, Sequence[float]],
    model_s: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    efficiency: Mapping[str, Sequence[float]],
    where: str,
    xlabel: str = "ranks N",
) -> Figure:
    """Two panels for step times measured on this machine. Left: for each kind of scaling in
    ``step_s`` (``{"weak": seconds at each rank count, "strong": ...}``), the measured DDP step
    in ms, and a band of its colour between the model's step times ``model_s[kind]`` = (with
    overlap, without). Right: the measured efficiency ``efficiency[kind]`` at each rank count.
    ``where`` (the machine) goes in the left title. Chapter 10, section 10.6."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 4.0), layout="constrained")
    for (kind, steps), marker in zip(step_s.items(), itertools.cycle("os^D")):
        (line,) = ax1.plot(ranks, np.array(steps) * 1e3, marker + "-",
                           label=f"{kind}: DDP step, measured")
        low, high = model_s[kind]
        ax1.fill_between(ranks, np.array(low) * 1e3, np.array(high) * 1e3,
                         color=line.get_color(), alpha=0.2,
                         label=f"{kind}: model, overlap 2/3 to 0")
        ax2.plot(ranks, efficiency[kind], marker + "-", label=f"{kind} scaling, measured")
    ax1.set(xlabel=xlabel, ylabel="ms per step (median)", xticks=ranks,
            title=f"DDP step of the MLP, {where}")
    ax2.set(xlabel=xlabel, ylabel="efficiency, measured", xticks=ranks, ylim=(0, 1.2),
            title="Measured scaling efficiency")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    _legend_below(fig, ax1, ax2)
    return fig


def _legend_below(fig: Figure, *axes: Axes, ncols: int = 3) -> None:
    """One legend for the panels, below them (inside, "best" still covered lines or bands)."""
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.append(handle)
            labels.append(label)
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=9)


def plot_steps_to_target(
    batches: Sequence[int],
    steps: Sequence[int],
    s_min: float,
    e_min: float,
    b_crit: float,
    target_loss: float,
    title: str,
) -> Figure:
    """Two panels, log-log. Left: the measured steps to ``target_loss`` at each batch size
    (dots), the fit ``S_min (1 + B_crit / B)`` (a line) and ``B_crit`` (dashed). Right: the
    trade-off curve ``(S/S_min - 1)(E/E_min - 1) = 1`` of
    :func:`~dpcourse.cost.noise_scale.tradeoff_examples` and the measured points scaled by the fit,
    each labelled with its batch size. Chapter 10, section 10.8."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 3.9), layout="constrained")
    bs = np.array(batches, dtype=float)
    grid = np.logspace(0, np.log10(batches[-1]), 100)
    ax1.plot(bs, steps, "o", label="measured (best learning rate)")
    ax1.plot(grid, s_min * (1 + b_crit / grid), "-", label=f"fit: S_min (1 + {b_crit:.1f} / B)")
    ax1.axvline(b_crit, color="grey", lw=0.8, ls="--")
    ax1.set(xscale="log", yscale="log", xlabel="batch size B",
            ylabel=f"steps to loss {target_loss:g}", title=title)
    ratio_s = np.linspace(1.02, 15, 200)
    ax2.plot(ratio_s, tradeoff_examples(ratio_s), "-",
             label="(S/S_min - 1)(E/E_min - 1) = 1 (modelled)")
    ax2.plot(np.array(steps) / s_min, bs * np.array(steps) / e_min, "o",
             label="measured, scaled by the fit")
    for b, s in zip(batches, steps, strict=True):
        ax2.annotate(str(b), (s / s_min, b * s / e_min), fontsize=9, xytext=(3, 3),
                     textcoords="offset points")
    ax2.set(xscale="log", yscale="log", xlabel="S / S_min (steps)", ylabel="E / E_min (examples)",
            title="Steps against examples")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    _legend_below(fig, ax1, ax2, ncols=2)
    return fig


def plot_two_level(result: Mapping, title: str) -> Figure:
    """Bars of the measured flat ring and two-level all-reduce per message size, the model's
    times as black ticks on them; ``result`` as :func:`dpcourse.harness.bench.hierarchical.
    measure_two_level` returns it (or its recorded JSON). Chapter 10, section 10.7."""
    names = ["flat ring", "two-level"]
    sizes = result["sizes"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    x = np.arange(len(sizes))
    for j, name in enumerate(names):
        at = x + (j - 0.5) * 0.38
        measured = np.array(result["measured"][name]) * 1e3
        ax.bar(at, measured, 0.36, label=f"{name}, measured", color=algorithm_colour(name))
        ax.scatter(at, np.array(result["model"][name]) * 1e3, marker="_", s=600, color="black",
                   zorder=3, label="alpha-beta model (fitted links)" if j == 0 else None)
    ax.set_xticks(x, [f"{s / 2**20:g} MiB" for s in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("all-reduce time (ms)")
    ax.set_title(title)
    ax.legend(fontsize=9)
    fig.tight_layout()
    return fig
