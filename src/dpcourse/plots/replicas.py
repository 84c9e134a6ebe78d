"""Plots for chapters 2-4 (data parallelism by hand). Like :mod:`dpcourse.plots.one_device`, each
function draws on ``ax`` (a new figure when ``None``), returns the axes, and never calls
``plt.show``.

Chapter 2: :func:`plot_shard_gradients`, :func:`plot_dropout_masks`, :func:`plot_chunks`,
:func:`plot_phase_times`, :func:`plot_curves`. Chapter 3: :func:`plot_chunks`,
:func:`plot_curves`. Chapter 4: :func:`plot_averaging_cost`, :func:`plot_runs`,
:func:`plot_batchnorm_statistics`.

Chapter 4: naive gradient averaging (the plots of chapters 2-4).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes

from dpcourse.replicas.averaging import Run
from dpcourse.replicas.replica_batchnorm import BatchNormStats

__all__ = [
    "plot_shard_gradients",
    "plot_dropout_masks",
    "plot_chunks",
    "plot_phase_times",
    "plot_curves",
    "plot_averaging_cost",
    "plot_runs",
    "plot_batchnorm_statistics",
]


def _axes(ax: Axes | None, figsize: tuple[float, float] = (6, 3.5)) -> Axes:
    return plt.subplots(figsize=figsize, layout="constrained")[1] if ax is None else ax


def plot_shard_gradients(
    shard_grads: torch.Tensor, whole: torch.Tensor, ax: Axes | None = None
) -> Axes:
    """A few gradient entries: one bar per shard (``shard_grads``: ``(n, m)``), their mean (a
    black line) and the whole batch's gradient (``whole``: ``(m,)``, a dot)."""
    ax = _axes(ax, (7, 3.5))
    n, m = shard_grads.shape
    width = 0.8 / n
    for i in range(n):
        ax.bar(np.arange(m) + (i - (n - 1) / 2) * width, shard_grads[i].tolist(), width,
               alpha=0.6, label=f"shard {i}")
    mean = shard_grads.mean(0).tolist()
    ax.hlines(mean, np.arange(m) - 0.4, np.arange(m) + 0.4, color="black", lw=2,
              label="mean of the shards")
    ax.plot(np.arange(m), whole.tolist(), "o", color="white", markeredgecolor="black",
            markersize=7, label="whole batch", zorder=3)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xticks(range(m), [f"entry {j}" for j in range(m)])
    ax.set_ylabel("gradient")
    ax.legend(fontsize=9, ncol=2)
    return ax


def plot_dropout_masks(masks: dict[str, torch.Tensor], axes: Sequence[Axes] | None = None):
    """Dropout masks ``(batch, features)`` side by side, one panel each (kept = dark)."""
    if axes is None:
        _, axes = plt.subplots(1, len(masks), figsize=(min(8.4, 2.8 * len(masks)), 3.2),
                               layout="constrained", sharey=True)
    axes = np.atleast_1d(axes)
    for ax, (title, mask) in zip(axes, masks.items(), strict=True):
        ax.imshow((mask != 0).float(), cmap="Greys", aspect="auto", interpolation="nearest",
                  vmin=0, vmax=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("feature")
    axes[0].set_ylabel("sample in the batch")
    return axes


def plot_chunks(splits: dict[str, Sequence[int]], ax: Axes | None = None) -> Axes:
    """How batches are split: one row per entry of ``splits`` (label -> chunk sizes), one
    coloured segment per chunk, labelled with its size."""
    ax = _axes(ax, (7, 0.55 * len(splits) + 1.2))
    colors = plt.get_cmap("tab10").colors
    for row, sizes in enumerate(splits.values()):
        start = 0
        for i, size in enumerate(sizes):
            ax.barh(row, size, left=start, color=colors[i % 10], edgecolor="white")
            ax.text(start + size / 2, row, str(size), ha="center", va="center", fontsize=9,
                    color="white")
            start += size
    ax.set_yticks(range(len(splits)), list(splits))
    ax.invert_yaxis()
    ax.set_xlabel("samples of the batch")
    ax.spines[["top", "right"]].set_visible(False)
    return ax


def plot_phase_times(
    times: dict[int, dict[str, float]],
    ax: Axes | None = None,
    phases: Sequence[str] | None = None,
) -> Axes:
    """Stacked bars: for each number of replicas (keys of ``times``), the milliseconds of each
    phase of a data-parallel step (``{phase: seconds}``); only ``phases`` if given (each keeps
    its colour)."""
    ax = _axes(ax, (7, 3.8))
    ns = list(times)
    every = list(next(iter(times.values())))
    bottom = np.zeros(len(ns))
    colors = plt.get_cmap("tab10").colors
    for k, phase in enumerate(every):
        if phases is not None and phase not in phases:
            continue
        values = np.array([times[n][phase] * 1e3 for n in ns])
        ax.bar([str(n) for n in ns], values, bottom=bottom, label=phase, color=colors[k % 10])
        bottom += values
    ax.set_xlabel("replicas (devices)")
    ax.set_ylabel("ms per step")
    # Room above the tallest bar for the legend, which covered the bars inside the axes.
    rows = -(-sum(phases is None or p in phases for p in every) // 2)
    ax.set_ylim(0, max(bottom) * (1.15 + 0.17 * rows))
    ax.legend(fontsize=9, ncol=2, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def plot_curves(
    x: Sequence[float],
    curves: dict[str, Sequence[float]],
    ax: Axes | None = None,
    xlabel: str = "",
    ylabel: str = "",
    logy: bool = False,
    style: str = "o-",
) -> Axes:
    """One line per entry of ``curves`` (label -> values at ``x``)."""
    ax = _axes(ax)
    for label, ys in curves.items():
        ax.plot(list(x), list(ys), style, label=label, markersize=4)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    return ax


def plot_averaging_cost(
    ns: Sequence[int], seconds: Sequence[float], nbytes: Sequence[int], axes=None
) -> Sequence[Axes]:
    """Two panels against the number of replicas: the time one averaging through the master
    took, and the bytes that went through the master (with the line through the origin)."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(8.4, 3.6), layout="constrained")
    ax1, ax2 = axes
    ax1.plot(ns, [s * 1e3 for s in seconds], "o-")
    ax1.set_ylabel("ms per averaging")
    ax1.set_ylim(bottom=0)
    mib = [b / 2**20 for b in nbytes]
    ax2.bar(ns, mib, color="tab:orange", label="measured")
    ax2.plot([0, max(ns)], [0, mib[0] / ns[0] * max(ns)], "k--", lw=1, label="proportional to N")
    ax2.set_ylabel("MiB through the master")
    ax2.legend()
    for ax in axes:
        ax.set_xlabel("replicas N")
        ax.grid(True, alpha=0.3)
    return axes


def plot_runs(
    runs: dict[str, Run], ax: Axes | None = None, styles: dict[str, str] | None = None
) -> Axes:
    """Loss against step for each :class:`~dpcourse.replicas.averaging.Run` (label -> run), log
    scale."""
    ax = _axes(ax, (7, 4))
    styles = styles or {}
    for label, run in runs.items():
        ax.plot(run.steps, run.losses, styles.get(label, "-"), label=label, markersize=3)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss on the whole data set")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    return ax


def plot_batchnorm_statistics(stats: BatchNormStats, axes=None) -> Sequence[Axes]:
    """Per channel, the mean and the variance one BatchNorm layer normalises with: each
    replica's (small dots) against the whole batch's (a black bar)."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(8.4, 3.4), layout="constrained")
    channels = np.arange(len(stats.whole_mean))
    for ax, whole, per_replica, name in (
        (axes[0], stats.whole_mean, stats.replica_means, "mean"),
        (axes[1], stats.whole_var, stats.replica_vars, "variance"),
    ):
        for i, values in enumerate(per_replica):
            ax.plot(channels + (i - (len(per_replica) - 1) / 2) * 0.12, values.tolist(), "o",
                    markersize=4, label=f"replica {i}")
        ax.hlines(whole.tolist(), channels - 0.35, channels + 0.35, color="black", lw=2,
                  label="whole batch")
        ax.set_xticks(channels)
        ax.set_xlabel("channel")
        ax.set_title(f"{stats.layer}: batch {name}", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[1].legend(fontsize=9)
    return axes
