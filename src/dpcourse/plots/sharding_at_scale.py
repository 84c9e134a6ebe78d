"""Plots of chapter 11: what FSDP's knobs cost, and DDP, FSDP and HSDP across emulated nodes.

Each function takes what the chapter measured or recorded (:mod:`dpcourse.harness.bench
.fsdp_knobs`, :mod:`dpcourse.harness.bench.hsdp`) and the model's curves the chapter computed
(:func:`dpcourse.sharding.hsdp.step_comm_time`), draws them on a new figure, returns it and never
calls ``plt.show``.

Chapter 11: plots of sharding at scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

__all__ = ["plot_knobs", "plot_strategies"]

COLOURS = {"ddp": "tab:blue", "fsdp": "tab:orange", "hsdp": "tab:green"}
LABELS = {"ddp": "DDP", "fsdp": "FSDP", "hsdp": "HSDP"}


def plot_knobs(results: Mapping[str, Mapping[str, Mapping]], title: str) -> Figure:
    """Bytes sent per step and memory after forward and at the peak, per configuration, ours and
    ``fully_shard``'s side by side (the ``results`` of
    :func:`dpcourse.harness.bench.fsdp_knobs.measure_knobs`). Chapter 11."""
    names = list(results)
    metrics = (("sent", "sent per step (MiB)"), ("forward", "held after forward (MiB)"),
               ("peak", "peak above the step's start (MiB)"))
    fig, axes = plt.subplots(1, 3, figsize=(8.4, 0.4 * len(names) + 1.8), sharey=True,
                             layout="constrained")
    y = np.arange(len(names))
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for offset, impl, colour in ((-0.2, "ours", "tab:green"),
                                     (0.2, "fully_shard", "tab:purple")):
            values = [results[n][impl][key] / 2**20 for n in names]
            ax.barh(y + offset, values, height=0.38, color=colour, label=impl)
        ax.set_xlabel(label, fontsize=9)
        ax.tick_params(labelsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, names)
    axes[0].invert_yaxis()
    axes[0].legend(fontsize=9, loc="lower right")
    fig.suptitle(title, fontsize=10)
    return fig


def plot_strategies(runs: Sequence[Mapping], curves: Mapping[str, Mapping[str, Sequence]],
                    rates_bits: Sequence[float], title: str) -> Figure:
    """Step time against the link rate between nodes, one panel per strategy (DDP, FSDP, HSDP;
    on one chart their six model lines, three series of points and the compute's crosses hid
    each other): its measured medians (``runs`` of
    :func:`dpcourse.harness.bench.hsdp.measure_strategies`) as points, ``curves``
    (``{"emulated": {strategy: seconds at each of rates_bits}, ...}``, the model) as lines, solid
    for the first view and dashed for the others, and the model alone (compute) as crosses, the
    same in each panel. Log-log, the same axes in each panel. Chapter 11."""
    strategies = list(COLOURS)
    fig, axes = plt.subplots(1, len(strategies), figsize=(8.4, 3.9), layout="constrained",
                             sharex=True, sharey=True)
    mbit = np.asarray(rates_bits) / 1e6
    measured_at = [r["rate_bits"] / 1e6 for r in runs]
    compute = [r["measured"]["compute"] * 1e3 for r in runs]
    for ax, s in zip(axes, strategies, strict=True):
        for v, (view, by_strategy) in enumerate(curves.items()):
            if s in by_strategy:
                ax.plot(mbit, np.asarray(by_strategy[s]) * 1e3, "-" if v == 0 else "--",
                        color=COLOURS[s], alpha=1.0 if v == 0 else 0.6,
                        label=f"model ({view})")
        ax.plot(measured_at, [r["measured"][s] * 1e3 for r in runs], "o", color=COLOURS[s],
                markersize=6, label="measured")
        ax.plot(measured_at, compute, "x", color="grey", label="the model alone (compute)")
        ax.set(xscale="log", yscale="log", title=LABELS[s])
        ax.grid(alpha=0.3, which="both")
        ax.set_xlabel("link between nodes (Mbit/s)")
    axes[0].set_ylabel("step time (ms)")
    fig.suptitle(title, fontsize=10)
    # The line styles and markers mean the same in every panel: one legend, in grey, below.
    handles = [plt.Line2D([], [], color="black", ls="-" if v == 0 else "--",
                          alpha=1.0 if v == 0 else 0.6, label=f"model ({view})")
               for v, view in enumerate(curves)]
    handles += [plt.Line2D([], [], color="black", marker="o", ls="", label="measured"),
                plt.Line2D([], [], color="grey", marker="x", ls="",
                           label="the model alone (compute)")]
    fig.legend(handles=handles, fontsize=9, ncols=len(handles), loc="outside lower center")
    return fig
