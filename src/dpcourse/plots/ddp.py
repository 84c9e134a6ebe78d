"""Plots of chapter 7: the communication timeline of DDP, step time against bucket size, overlap
on and off for each bucket size (on a slow link), and the animation of buckets filling during
backward and leaving, drawn from the reducer's own events (:func:`bucket_animation`).

Chapter 7: plots of DDP's timeline and bucket sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib import animation
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from dpcourse.ddp.timeline import BucketEvent, StepTimeline

__all__ = ["bucket_animation", "plot_timeline", "plot_bucket_sizes", "plot_overlap",
           "overlap_table"]

# The colours of chapter 7's figures: backward's (the timeline's bars), an all-reduce's.
BACKWARD, ALL_REDUCE, AVERAGED = "#4c72b0", "#dd8452", "#55a868"


def _draw_timeline(ax: Axes, timeline: StepTimeline, title: str) -> None:
    n = len(timeline.buckets)
    ms = 1e3
    ax.barh(n, timeline.backward_s * ms, left=0, height=0.6, color="#4c72b0")
    ax.text(
        timeline.backward_s * ms / 2,
        n,
        "backward",
        ha="center",
        va="center",
        color="white",
        fontsize=9,
    )
    for b in timeline.buckets:
        row = n - 1 - b.index
        width = max(b.completed_s - b.launched_s, 0) * ms
        ax.barh(row, width, left=b.launched_s * ms, height=0.6, color="#dd8452")
    ax.axvline(timeline.backward_s * ms, color="#4c72b0", ls="--", lw=1)
    ax.axvline(timeline.finished_s * ms, color="k", ls=":", lw=1)
    labels = [f"bucket {b.index} ({b.nbytes / 2**20:.1f} MiB)" for b in reversed(timeline.buckets)]
    ax.set_yticks(range(n + 1), labels + ["compute"])
    ax.set(xlabel="ms since backward started", title=title)
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(timelines: Mapping[str, StepTimeline], machine: str) -> Figure:
    """One panel per timeline (e.g. ``{"overlap=True": ..., "overlap=False": ...}``): backward
    as a bar, each bucket's all-reduce from launch to completion, backward's end (dashed) and
    the end of ``finish_gradient_synchronization`` (dotted). Chapter 7."""
    fig, axes = plt.subplots(
        len(timelines),
        1,
        figsize=(8, 1.2 + 0.45 * sum(len(t.buckets) + 1 for t in timelines.values())),
        sharex=True,
        layout="constrained",
        squeeze=False,
    )
    for ax, (title, timeline) in zip(axes[:, 0], timelines.items(), strict=True):
        _draw_timeline(
            ax, timeline, f"{title}: step synchronised after {timeline.finished_s * 1e3:.1f} ms"
        )
    fig.suptitle(f"Measured on {machine}", fontsize=9)
    return fig


def plot_bucket_sizes(
    caps_mb: Sequence[float],
    medians_s: Sequence[float],
    reference: Mapping[str, float],
    machine: str,
    title: str,
) -> Figure:
    """Median step time of :class:`~dpcourse.ddp.ddp.DDP` for each bucket cap, with horizontal
    lines for the ``reference`` times (e.g. torch's DDP). A cap of 0 (one bucket per
    parameter) is drawn at the left edge of the log axis. Chapter 7."""
    fig, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
    smallest = min((c for c in caps_mb if c > 0), default=1.0) / 4
    xs = [c if c > 0 else smallest for c in caps_mb]
    ax.plot(xs, [t * 1e3 for t in medians_s], "o-", label="DDP (from scratch), overlapped")
    for (name, t), style in zip(reference.items(), ("--", ":", "-."), strict=False):
        ax.axhline(t * 1e3, ls=style, color="grey", label=name)
    ticks = [f"{c:g}" if c > 0 else "0 (per\nparameter)" for c in caps_mb]
    ax.set_xscale("log")
    ax.set_xticks(xs, ticks)
    ax.minorticks_off()
    ax.set(
        xlabel="bucket_cap_mb (MiB)",
        ylabel="ms per training step (median)",
        title=f"{title}\nmeasured on {machine}",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return fig


def plot_overlap(
    caps_mb: Sequence[float],
    overlapped_s: Sequence[float],
    after_backward_s: Sequence[float],
    bucket_counts: Sequence[int],
    reference: Mapping[str, float],
    title: str,
    source: str,
) -> Figure:
    """Median step time for each bucket cap as a pair of bars: the buckets launched during
    backward (overlapped) and the same buckets launched after it, each bar labelled in ms and
    each pair with its cap and number of buckets; horizontal lines for the ``reference`` times
    (e.g. the step without communication). ``source`` (where and when it was measured, or that
    it was recorded) is the title's second line. Chapter 7."""
    if not len(caps_mb) == len(overlapped_s) == len(after_backward_s) == len(bucket_counts):
        raise ValueError(
            "caps_mb, overlapped_s, after_backward_s and bucket_counts differ in length"
        )
    fig, ax = plt.subplots(figsize=(6.5, 4.6), layout="constrained")
    xs = range(len(caps_mb))
    width = 0.38
    for offset, times, label, color in (
        (-width / 2, overlapped_s, "overlapped (launched during backward)", "#dd8452"),
        (width / 2, after_backward_s, "no overlap (launched after backward)", "#8c8c8c"),
    ):
        bars = ax.bar([x + offset for x in xs], [t * 1e3 for t in times], width, label=label,
                      color=color)
        ax.bar_label(bars, fmt="%.0f", fontsize=9)
    for (name, t), style in zip(reference.items(), ("--", ":", "-."), strict=False):
        ax.axhline(t * 1e3, ls=style, color="k", lw=1, label=name)
    ticks = [f"{c:g} MiB\n{n} bucket{'s' if n != 1 else ''}"
             for c, n in zip(caps_mb, bucket_counts, strict=True)]
    ax.set_xticks(list(xs), ticks)
    ax.set(xlabel="bucket_cap_mb", ylabel="ms per step (median)", title=f"{title}\n{source}")
    highest = max([*overlapped_s, *after_backward_s, *reference.values()]) * 1e3
    ax.set_ylim(0, highest * 1.12)  # room for the bars' labels
    ax.grid(axis="y", alpha=0.3)
    # Below the axes, outside them: inside, two columns of long labels covered the top of the
    # bars, the top tick and the y label.
    fig.legend(loc="outside lower center", ncols=2, fontsize=9)
    return fig


def overlap_table(medians: dict[str, float], over_none: dict[str, float], caps_mb: list,
                  bucket_counts: list[int]) -> str:
    """Chapter 7's slow-link table: for "none" and each cap's overlapped and after-backward
    variant (``"DDP cap C"``, ``"DDP no overlap cap C"``), the buckets, the median step and
    what it costs over "none" (``over_none``, seconds, same-round differences)."""
    lines = [f"{'variant':<23} {'buckets':>7} {'median step':>12} {'over none':>10}",
             f"{'none':<23} {'-':>7} {medians['none'] * 1e3:9.1f} ms"]
    for cap, n in zip(caps_mb, bucket_counts, strict=True):
        for name in (f"DDP cap {cap}", f"DDP no overlap cap {cap}"):
            lines.append(f"{name:<23} {n:>7} {medians[name] * 1e3:9.1f} ms "
                         f"{over_none[name] * 1e3:7.1f} ms")
    return "\n".join(lines)


def _bucket_states(events: Sequence[BucketEvent], slots: Sequence[Sequence[int]]) -> list[dict]:
    """After each event (and before the first): which slots hold their gradient and each
    bucket's state ("filling", "in flight", "averaged"), with a caption."""
    ready = [[False] * len(s) for s in slots]
    state = ["filling"] * len(slots)
    frames = [{"ready": [r[:] for r in ready], "state": state[:],
               "caption": "backward starts: every bucket is empty"}]
    for e in events:
        if e.kind == "ready":
            ready[e.bucket][e.slot] = True
            caption = f"{e.seconds * 1e3:.1f} ms: a gradient enters bucket {e.bucket}"
        elif e.kind == "launched":
            state[e.bucket] = "in flight"
            caption = f"{e.seconds * 1e3:.1f} ms: bucket {e.bucket} is full: its all-reduce leaves"
        else:
            state[e.bucket] = "averaged"
            caption = f"{e.seconds * 1e3:.1f} ms: bucket {e.bucket}'s all-reduce completed"
        frames.append({"ready": [r[:] for r in ready], "state": state[:], "caption": caption})
    return frames


def bucket_animation(events: Sequence[BucketEvent], slots: Sequence[Sequence[int]],
                     title: str, interval_ms: int = 900) -> animation.FuncAnimation:
    """DDP's buckets during one backward, one frame per event of the reducer
    (:func:`dpcourse.ddp.timeline.bucket_events`): each bucket a row of slots as wide as its
    parameters' bytes, a slot filled when its gradient arrives, the bucket drawn in the
    all-reduce's colour from its launch and in green once averaged. ``.to_jshtml()`` plays it on
    a static page. Chapter 7, section 7.5."""
    frames = _bucket_states(events, slots)
    widest = max(sum(s) for s in slots)
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.55 * len(slots)), layout="constrained")

    def draw(i: int) -> None:
        frame = frames[i]
        ax.clear()
        for b, sizes in enumerate(slots):
            y, left = len(slots) - 1 - b, 0.0
            colour = {"filling": None, "in flight": ALL_REDUCE, "averaged": AVERAGED}[
                frame["state"][b]]
            for k, size in enumerate(sizes):
                width = size / widest
                filled = frame["ready"][b][k]
                ax.add_patch(Rectangle((left, y - 0.35), width, 0.7, edgecolor="black", lw=0.8,
                                       facecolor=(colour or BACKWARD) if filled else "white"))
                left += width
            ax.text(-0.01, y, f"bucket {b}", ha="right", va="center", fontsize=10)
            ax.text(left + 0.01, y, frame["state"][b], ha="left", va="center", fontsize=10,
                    color=colour or "black")
        ax.set_xlim(-0.16, 1.2)
        ax.set_ylim(-0.7, len(slots) - 0.3)
        ax.axis("off")
        ax.set_title(f"{title}\n{frame['caption']}", fontsize=11)

    draw(0)
    fig.legend(handles=[Patch(facecolor="white", edgecolor="black", label="no gradient yet"),
                        Patch(facecolor=BACKWARD, label="gradient in (backward)"),
                        Patch(facecolor=ALL_REDUCE, label="all-reduce in flight"),
                        Patch(facecolor=AVERAGED, label="averaged")],
               loc="outside lower center", ncols=4, fontsize=9)
    anim = animation.FuncAnimation(fig, draw, frames=len(frames), interval=interval_ms)
    plt.close(fig)  # the notebook shows the animation, not a stray still figure
    return anim
