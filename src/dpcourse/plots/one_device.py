"""Plots for the chapters, so that notebooks stay short. Each function draws on ``ax`` (a new
figure when ``None``) and returns the axes; nothing here calls ``plt.show``.

:func:`plot_dataset`, :func:`plot_mlp`, :func:`plot_loss`, :func:`plot_throughput`,
:func:`plot_memory_breakdown`, :func:`plot_will_it_fit`.

Chapter 1: plots of the data, the model, the loss, throughput and memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from torch import nn
from torch.utils.data import TensorDataset

from dpcourse.one_device.memory import MemoryBreakdown, will_it_fit
from dpcourse.one_device.training import History

__all__ = [
    "plot_dataset",
    "plot_mlp",
    "plot_loss",
    "plot_throughput",
    "plot_memory_breakdown",
    "plot_will_it_fit",
]

_PART_COLORS = {
    "parameters": "tab:blue",
    "gradients": "tab:orange",
    "optimizer_state": "tab:green",
    "activations": "tab:red",
}
_UNIT_BYTES = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _axes(ax: Axes | None, figsize: tuple[float, float] = (6, 3.5)) -> Axes:
    return plt.subplots(figsize=figsize, layout="constrained")[1] if ax is None else ax


def plot_dataset(dataset: TensorDataset, axes: Sequence[Axes] | None = None) -> Sequence[Axes]:
    """Inputs and targets of a regression data set as two heat maps, one column per sample."""
    x, y = dataset.tensors
    if axes is None:
        fig, axes = plt.subplots(
            2, 1, figsize=(8.4, 3.4), sharex=True, layout="constrained",
            gridspec_kw={"height_ratios": [x.shape[1], y.shape[1]]},
        )
    for ax, t, name in zip(axes, (x, y), ("inputs x", "targets y"), strict=True):
        lim = float(t.abs().max())
        im = ax.imshow(t.T, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim,
                       interpolation="nearest")
        ax.set_ylabel(f"{name}\n({t.shape[1]} values)")
        ax.set_yticks(range(t.shape[1]))
        ax.figure.colorbar(im, ax=ax, pad=0.01)
    axes[-1].set_xlabel(f"sample (0 to {len(x) - 1})")
    return axes


def plot_mlp(model: nn.Module, ax: Axes | None = None, max_nodes: int = 10) -> Axes:
    """The Linear layers of ``model`` as a diagram of neurons and connections.

    Layers wider than ``max_nodes`` show ``max_nodes`` neurons, a gap, and their true width.
    """
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    widths = [linears[0].in_features] + [m.out_features for m in linears]
    ax = _axes(ax, (7, 3.5))
    positions = []
    for i, width in enumerate(widths):
        shown = min(width, max_nodes)
        ys = np.linspace(-1, 1, shown) if shown > 1 else np.zeros(1)
        if width > max_nodes:  # leave a gap in the middle for the "..."
            ys = ys * 1.0 + np.sign(ys) * 0.08
        positions.append(ys)
        ax.scatter(np.full(shown, i), ys, s=120, zorder=3, color="white", edgecolor="black")
        kind = "input" if i == 0 else ("output" if i == len(widths) - 1 else f"hidden {i}")
        ax.text(i, -1.35, f"{kind}\n{width}", ha="center", va="top")
        if width > max_nodes:
            ax.text(i, 0, "⋮", ha="center", va="center", fontsize=14)
    for i, layer in enumerate(linears):
        for y0 in positions[i]:
            for y1 in positions[i + 1]:
                ax.plot([i, i + 1], [y0, y1], color="gray", lw=0.4, alpha=0.5, zorder=1)
        label = f"Linear\n{layer.in_features}×{layer.out_features}"
        label += " + ReLU" if i < len(linears) - 1 else ""
        ax.text(i + 0.5, 1.25, label, ha="center", va="bottom", fontsize=9)
    ax.set_xlim(-0.4, len(widths) - 0.6)
    ax.set_ylim(-1.9, 1.7)
    ax.axis("off")
    return ax


def plot_loss(history: History, ax: Axes | None = None, label: str | None = None) -> Axes:
    """Per-step training loss (thin line) and each epoch's mean loss (a horizontal segment
    spanning that epoch's steps), log scale."""
    ax = _axes(ax)
    steps = np.arange(1, history.steps + 1)
    line = ax.plot(steps, history.step_losses, lw=0.8, alpha=0.6, label=label or "each step")[0]
    starts = [0, *history.epoch_ends[:-1]]
    ax.hlines(history.epoch_losses, np.array(starts) + 0.5, np.array(history.epoch_ends) + 0.5,
              color=line.get_color(), lw=2.5,
              label=f"{label} (epoch mean)" if label else "epoch mean")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return ax


def plot_throughput(
    results: Sequence[tuple[int, float]], ax: Axes | None = None, label: str | None = None
) -> Axes:
    """Samples per second against batch size, both axes logarithmic."""
    ax = _axes(ax)
    sizes, rates = zip(*results, strict=True)
    ax.plot(sizes, rates, "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples / s (training)")
    ax.grid(True, which="both", alpha=0.3)
    if label:
        ax.legend()
    return ax


def plot_memory_breakdown(
    breakdowns: dict[str, MemoryBreakdown],
    ax: Axes | None = None,
    unit: str = "KiB",
    title: str | None = None,
) -> Axes:
    """Grouped bars: one group per part of memory, one bar per breakdown (e.g. estimated and
    measured)."""
    ax = _axes(ax)
    parts = list(_PART_COLORS)
    width = 0.8 / len(breakdowns)
    hatches = ["", "//", "..", "xx"]
    for j, (name, b) in enumerate(breakdowns.items()):
        values = [getattr(b, p) / _UNIT_BYTES[unit] for p in parts]
        ax.bar(np.arange(len(parts)) + (j - (len(breakdowns) - 1) / 2) * width, values, width,
               color=[_PART_COLORS[p] for p in parts], hatch=hatches[j % len(hatches)],
               edgecolor="black", label=name)
    ax.set_xticks(range(len(parts)), [p.replace("_", "\n") for p in parts])
    ax.set_ylabel(unit)
    # The legend tells the bars apart by hatching; their colours name the parts on the x axis.
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black",
                             hatch=hatches[j % len(hatches)]) for j in range(len(breakdowns))]
    ax.legend(handles, list(breakdowns))
    if title:
        ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def plot_will_it_fit(
    model_sizes: dict[str, int],
    gpus: dict[str, float],
    optimizer: str = "adam",
    bytes_per_param: int = 4,
    ax: Axes | None = None,
) -> Axes:
    """Stacked bars of the memory each model needs (parameters, gradients, optimizer state, in
    GiB) against horizontal lines at each GPU's memory (``gpus``: name -> GiB)."""
    ax = _axes(ax, (7, 4))
    bottoms = np.zeros(len(model_sizes))
    needs = [will_it_fit(n, 1, optimizer, bytes_per_param)[1] for n in model_sizes.values()]
    for part in ("parameters", "gradients", "optimizer_state"):
        values = np.array([getattr(b, part) / 2**30 for b in needs])
        ax.bar(list(model_sizes), values, bottom=bottoms, color=_PART_COLORS[part],
               label=part.replace("_", " "))
        bottoms += values
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:,.0f} GiB" if total >= 100 else f"{total:.1f} GiB",
                ha="center", va="bottom")
    for k, (name, gib) in enumerate(gpus.items()):
        ax.axhline(gib, color="black", ls=["--", ":", "-."][k % 3], lw=1.2,
                   label=f"{name}: {gib:.0f} GiB")
    ax.set_xlabel("parameters")
    ax.set_ylabel("GiB (no activations)")
    per_param = needs[0].total / max(next(iter(model_sizes.values())), 1)
    ax.set_title(f"{optimizer}, {bytes_per_param} bytes per value: {per_param:.0f} bytes per "
                 "parameter")
    # Above the tallest bar and line (the GPUs' lines cross the whole width, under any legend
    # placed beside them): the y axis goes that much higher.
    top = max(max(bottoms), *gpus.values()) if gpus else max(bottoms)
    ax.set_ylim(0, top * (1.5 + 0.12 * len(gpus)))
    ax.legend(loc="upper left", fontsize=9, ncols=2)
    return ax
