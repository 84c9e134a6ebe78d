"""Plots of chapter 11: what FSDP's knobs cost, DDP, FSDP and HSDP across emulated nodes, and
HSDP's mesh of ranks with its shard and replicate groups, as the ranks' own groups report them
(:func:`plot_hsdp_mesh`).

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
from matplotlib.patches import FancyBboxPatch

__all__ = ["plot_hsdp_mesh", "plot_knobs", "plot_strategies"]

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


def plot_hsdp_mesh(ranks: Sequence[Mapping]) -> Figure:
    """HSDP's 2-D mesh as the ranks report it: ``ranks[r]`` is rank r's ``{"shard_group":
    [ranks], "replicate_group": [ranks], "rows": (start, stop), "of": rows}`` (its process
    groups' members and the rows of a layer it holds). A row of the figure per shard group (a
    node: FSDP inside it, each rank its own rows), linked down the columns by the replicate
    groups (the ranks that hold the same rows, one per node, which all-reduce their gradients).
    Chapter 11."""
    shard_groups = sorted({tuple(r["shard_group"]) for r in ranks})
    replicate_groups = sorted({tuple(r["replicate_group"]) for r in ranks})
    k = len(shard_groups[0])
    fig, ax = plt.subplots(figsize=(6.5, 1.3 + 1.45 * len(shard_groups)), layout="constrained")
    where = {}
    for node, group in enumerate(shard_groups):
        y = len(shard_groups) - 1 - node
        ax.add_patch(FancyBboxPatch((-0.45, y - 0.42), k - 0.1, 0.84,
                                    boxstyle="round,pad=0.02", facecolor="#eef3fb",
                                    edgecolor="#4c72b0", lw=1.5))
        ax.text(-0.5, y, f"node {node}\nshard group\n{list(group)}", ha="right", va="center",
                fontsize=9, color="#4c72b0")
        for col, rank in enumerate(group):
            where[rank] = (col, y)
            start, stop = ranks[rank]["rows"]
            ax.add_patch(FancyBboxPatch((col - 0.33, y - 0.28), 0.66, 0.56,
                                        boxstyle="round,pad=0.02", facecolor="white",
                                        edgecolor="black"))
            ax.text(col, y, f"rank {rank}\nrows {start}-{stop - 1}\nof {ranks[rank]['of']}",
                    ha="center", va="center", fontsize=9)
    for group in replicate_groups:
        points = [where[r] for r in group]
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, ls="--", color="#dd8452", lw=2, zorder=0)
        ax.text(xs[0] + 0.36, (max(ys) + min(ys)) / 2, f"replicate\ngroup\n{list(group)}",
                va="center", fontsize=9, color="#dd8452")
    ax.set(xlim=(-1.6, k + 0.2), ylim=(-0.6, len(shard_groups) - 0.4))
    ax.axis("off")
    ax.set_title(f"HSDP on {len(ranks)} ranks: shard inside a node, replicate across nodes",
                 fontsize=10)
    return fig
