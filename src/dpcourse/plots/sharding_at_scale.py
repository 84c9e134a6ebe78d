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
    """Step time against the link rate between nodes: each strategy's measured medians (``runs``
    of :func:`dpcourse.harness.bench.hsdp.measure_strategies`) as points, and ``curves``
    (``{"emulated": {strategy: seconds at each of rates_bits}, ...}``, the model) as lines,
    solid for the first view and dashed for the others. Log-log. Chapter 11."""
    fig, ax = plt.subplots(figsize=(8.4, 5.6), layout="constrained")
    mbit = np.asarray(rates_bits) / 1e6
    for v, (view, by_strategy) in enumerate(curves.items()):
        for s, seconds in by_strategy.items():
            ax.plot(mbit, np.asarray(seconds) * 1e3, "-" if v == 0 else "--",
                    color=COLOURS[s], alpha=1.0 if v == 0 else 0.6,
                    label=f"{LABELS[s]}, model ({view})")
    for s in COLOURS:
        xs = [r["rate_bits"] / 1e6 for r in runs]
        ys = [r["measured"][s] * 1e3 for r in runs]
        ax.plot(xs, ys, "o", color=COLOURS[s], markersize=7, label=f"{LABELS[s]}, measured")
    compute = [r["measured"]["compute"] * 1e3 for r in runs]
    ax.plot([r["rate_bits"] / 1e6 for r in runs], compute, "x", color="grey",
            label="the model alone (compute)")
    ax.set(xscale="log", yscale="log", xlabel="link between nodes (Mbit/s)",
           ylabel="step time (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
    fig.legend(fontsize=9, ncol=3, loc="outside lower center")
    return fig
