"""Plots of chapter 12: DiLoCo's rounds and Streaming DiLoCo's fragments as they ran, the loss of
each method against steps and seconds, and seconds to a target loss against the link.

Each function takes what the chapter ran or recorded (the events a run logged,
:mod:`dpcourse.harness.bench.slow_links`' results) and the model's values the chapter computed,
draws them on a new figure, returns it and never calls ``plt.show``.

Chapter 12: plots of communicating less.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

__all__ = ["colour", "plot_rounds", "plot_losses", "plot_time_to_target", "plot_curves"]


def colour(i: int) -> str:
    return plt.get_cmap("tab10")(i % 10)


def plot_rounds(schedules: Mapping[str, Sequence[tuple[int, int, str]]], steps: int,
                title: str) -> Figure:
    """One panel per schedule (``{"DiLoCo, H = 8": [(step, fragment, "send" | "receive")...]}``,
    the events a run logged): a row per fragment, a tick per inner step, a bar from each send to
    its receive (the all-reduce in flight while inner steps go on), a dot at the outer step."""
    fig, axes = plt.subplots(len(schedules), 1, figsize=(8.4, 1.2 + 0.55 * sum(
        1 + max((f for _, f, _ in ev), default=0) for ev in schedules.values())),
        layout="constrained", sharex=True)
    axes = np.atleast_1d(axes)
    for ax, (name, events) in zip(axes, schedules.items(), strict=True):
        rows = 1 + max((f for _, f, _ in events), default=0)
        for r in range(rows):
            ax.plot(np.arange(1, steps + 1), [r] * steps, "|", color="0.6", markersize=7)
        sends = {}
        for step, frag, kind in events:
            if kind == "send":
                sends[frag] = step
            else:
                start = sends.pop(frag, step)
                ax.broken_barh([(start - 0.3, step - start + 0.6)], (frag - 0.22, 0.44),
                               color=colour(frag), alpha=0.55)
                ax.plot([step], [frag], "o", color=colour(frag), markersize=6)
        ax.set_yticks(range(rows), [f"fragment {r}" if rows > 1 else "whole model"
                                    for r in range(rows)], fontsize=9)
        ax.set_ylim(rows - 0.5, -0.5)
        ax.set_title(name, fontsize=9, loc="left")
        ax.tick_params(labelsize=9)
    axes[-1].set_xlabel("inner step (ticks); bar: pseudo-gradient in flight; dot: outer step",
                        fontsize=9)
    fig.suptitle(title, fontsize=10)
    return fig


def plot_losses(results: Mapping[str, Mapping], target: float, title: str) -> Figure:
    """Held-out loss against steps (left) and against training seconds (right, log) for each
    method of ``results`` (one link's :func:`dpcourse.harness.bench.slow_links.measure_rate`
    results), with the target as a dotted line."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.4, 4.0), layout="constrained",
                                      sharey=True)
    for i, (name, r) in enumerate(results.items()):
        steps, loss, seconds = zip(*r["curve"], strict=True)
        style = "-" if i < 4 else ("--" if i < 8 else ":")
        left.plot(steps, loss, style, color=colour(i), label=name, linewidth=1.3)
        right.plot(np.maximum(seconds, 1e-2), loss, style, color=colour(i), linewidth=1.3)
    for ax in (left, right):
        ax.axhline(target, color="k", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=9)
    left.set_xlabel("step", fontsize=9)
    right.set_xlabel("training seconds (rank 0)", fontsize=9)
    right.set_xscale("log")
    left.set_ylabel("held-out MSE", fontsize=9)
    left.legend(fontsize=9, ncol=2)
    fig.suptitle(title, fontsize=10)
    return fig


def plot_time_to_target(runs: Sequence[Mapping], nodes: int, title: str) -> Figure:
    """Seconds to the target loss against the link rate (log-log) for each method: the measured
    ones as dots joined by lines, the model's (the measured steps times the modelled step) as
    crosses, for the runs of ``nodes`` nodes."""
    mine = sorted((r for r in runs if r["nodes"] == nodes), key=lambda r: r["rate_bits"])
    fig, ax = plt.subplots(figsize=(8.4, 4.8), layout="constrained")
    mbit = [r["rate_bits"] / 1e6 for r in mine]
    for i, name in enumerate(mine[0]["results"]):
        got = [r["results"][name]["seconds_to_target"] for r in mine]
        model = [r["results"][name]["model_seconds_to_target"] for r in mine]
        style = "-" if i < 4 else ("--" if i < 8 else ":")
        ax.plot(mbit, [np.nan if s is None else s for s in got], style + "o", color=colour(i),
                label=name, markersize=5)
        ax.plot(mbit, [np.nan if s is None else s for s in model], "x", color=colour(i),
                markersize=7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link between nodes (Mbit/s)", fontsize=9)
    ax.set_ylabel("seconds to the target loss", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9, ncol=3)
    fig.suptitle(title, fontsize=10)
    return fig


def plot_curves(curves: Mapping[str, tuple[Sequence[float], Sequence[float]]], xlabel: str,
                title: str) -> Figure:
    """Loss curves ``{label: (x, loss)}`` on a log loss axis: the chapter's "what it costs"
    runs."""
    fig, ax = plt.subplots(figsize=(8.4, 3.8), layout="constrained")
    for i, (label, (x, loss)) in enumerate(curves.items()):
        ax.plot(x, loss, color=colour(i), label=label, linewidth=1.3)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel("held-out MSE", fontsize=9)
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9)
    fig.suptitle(title, fontsize=10)
    return fig
