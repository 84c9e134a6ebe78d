"""Ring all-reduce, step by step: the animation and the explorer of chapter 6.

The frames follow :func:`dpcourse.collectives.ring.ring_schedule`, the schedule the real ring
runs, and track which ranks' contributions each chunk holds: at the start rank r holds only its
own ("a" for rank 0, "b" for rank 1, ...); after the reduce-scatter rank r holds the sum of
chunk r ("a+b+c+d"); after the all-gather every rank holds every sum. Chapter 6 checks that the
final state equals what the real ring computes. :func:`plot_bytes_per_rank` draws the bytes
each algorithm's busiest rank sends, counted against the formulas.

Chapter 6: the ring all-reduce animated, and the bytes each rank sends.
"""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import matplotlib.pyplot as plt
from matplotlib import animation
from matplotlib.colors import to_hex
from matplotlib.patches import FancyArrowPatch, Rectangle

from dpcourse.collectives.ring import ring_schedule
from dpcourse.plots import algorithm_colour

__all__ = ["RingFrame", "ring_frames", "ring_figsize", "draw_ring_frame", "ring_animation",
           "ring_explorer"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class RingFrame:
    """One picture: what each rank's chunks hold, and the chunks in flight."""

    phase: str  # "start", "reduce-scatter", "all-gather" or "done"
    step: int  # 1-based within the phase (0 for start and done)
    holdings: tuple[tuple[frozenset[int], ...], ...]  # [rank][chunk] -> contributing ranks
    arrows: tuple[tuple[int, int, int], ...]  # (from rank, to rank, chunk)
    caption: str



def ring_figsize(world: int) -> tuple[float, float]:
    """Inches for a ring of ``world`` ranks: grows with the ring, but never wider than the book's
    column (8.4 inches at 100 dpi), so that its labels keep their size on the page."""
    width, height = 1.6 + 1.3 * world, 1.2 + 0.9 * world
    shrink = min(1.0, 8.4 / width)
    return width * shrink, height * shrink


def ring_frames(world: int) -> list[RingFrame]:
    """Every frame of a ring all-reduce on ``world`` ranks: start, then for each step of each
    phase the messages in flight and the result, then the end state."""
    if world < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {world}")
    hold = [[frozenset({r}) for _ in range(world)] for r in range(world)]

    def snapshot():
        return tuple(tuple(row) for row in hold)

    frames = [
        RingFrame(
            "start",
            0,
            snapshot(),
            (),
            f"{world} ranks, each with its own gradient cut into {world} chunks",
        )
    ]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            sends = [ring_schedule(phase, r, step, world) for r in range(world)]
            arrows = tuple((r, (r + 1) % world, sends[r][0]) for r in range(world))
            verb = "adds it to its own" if phase == "reduce-scatter" else "keeps it"
            frames.append(
                RingFrame(
                    phase,
                    step + 1,
                    snapshot(),
                    arrows,
                    f"{phase}, step {step + 1} of {world - 1}: every rank sends one chunk to its "
                    f"right neighbour, which {verb}",
                )
            )
            incoming = {}
            for r in range(world):
                dst = (r + 1) % world
                sent = sends[r][0]
                received = ring_schedule(phase, dst, step, world)[1]
                assert sent == received, "sender and receiver disagree on the chunk"
                incoming[dst] = (received, hold[r][sent])
            for dst, (chunk, contribution) in incoming.items():
                if phase == "reduce-scatter":
                    hold[dst][chunk] = hold[dst][chunk] | contribution
                else:
                    hold[dst][chunk] = contribution
        last = (
            "every rank holds the complete sum of one chunk: its own"
            if phase == "reduce-scatter"
            else "every rank holds every sum: the all-reduce is done"
        )
        frames.append(
            RingFrame("done" if phase == "all-gather" else phase, 0, snapshot(), (), last)
        )
    return frames


def _label(contributors: frozenset[int], world: int) -> str:
    if len(contributors) == world and world > 4:
        return "Σ all"
    return "+".join(_LETTERS[i] for i in sorted(contributors))


def draw_ring_frame(frame: RingFrame, ax: plt.Axes | None = None) -> plt.Axes:
    """Draw one frame: ranks as rows, chunks as columns, messages as arrows."""
    ax = ax or plt.gca()
    ax.clear()
    world = len(frame.holdings)
    cmap = plt.get_cmap("Blues")
    w, h = 1.0, 0.62
    for r, row in enumerate(frame.holdings):
        y = -r
        ax.text(-0.35, y + h / 2, f"rank {r}", ha="right", va="center", fontsize=10)
        for c, who in enumerate(row):
            full = len(who) / world
            ax.add_patch(
                Rectangle(
                    (c * 1.25, y),
                    w,
                    h,
                    facecolor=cmap(0.15 + 0.75 * full),
                    edgecolor="black",
                    linewidth=1.5 if len(who) == world else 0.6,
                )
            )
            ax.text(
                c * 1.25 + w / 2,
                y + h / 2,
                _label(who, world),
                ha="center",
                va="center",
                fontsize=9 if world <= 4 else 7,
                color="white" if full > 0.6 else "black",
            )
    for src, dst, chunk in frame.arrows:
        x = chunk * 1.25 + w / 2
        if dst == src + 1:
            start, end, rad = (x + 0.18, -src), (x + 0.18, -dst + h), 0.0
        else:  # the wrap-around from the last rank to rank 0
            start, end, rad = (x + 0.42, -src + h / 2), (x + 0.42, h / 2), 0.35
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                arrowstyle="-|>",
                mutation_scale=14,
                color="#d62728",
                linewidth=2,
                connectionstyle=f"arc3,rad={rad}",
            )
        )
    for c in range(world):
        ax.text(c * 1.25 + w / 2, h + 0.25, f"chunk {c}", ha="center", fontsize=9)
    ax.set_xlim(-1.4, world * 1.25 + 0.3)
    ax.set_ylim(-(world - 1) - 0.4, h + 0.6)
    # The caption wraps to the figure's width (a 10 pt character is about 6 points wide): on one
    # line the longest, 104 characters, ran past both edges of the 4-rank animation's frames.
    chars = int(ax.figure.get_figwidth() * 72 / 6)
    ax.set_title(textwrap.fill(frame.caption, chars), fontsize=10)
    ax.axis("off")
    return ax


def ring_animation(world: int = 4, interval_ms: int = 1200) -> animation.FuncAnimation:
    """The whole all-reduce as a matplotlib animation (``.to_jshtml()`` plays it on a static
    web page, no kernel needed)."""
    frames = ring_frames(world)
    fig, ax = plt.subplots(figsize=ring_figsize(world))
    anim = animation.FuncAnimation(
        fig, lambda i: draw_ring_frame(frames[i], ax), frames=len(frames), interval=interval_ms
    )
    plt.close(fig)  # the notebook shows the animation, not a stray still figure
    return anim


def explorer_frames(max_world: int = 8) -> dict[int, list[dict]]:
    """The frames of :func:`ring_frames` for 2 to ``max_world`` ranks as plain data, drawn as
    :func:`draw_ring_frame` draws them: per frame its caption, the messages in flight as
    ``[from rank, to rank, chunk]``, and per rank and chunk the label, fill and text colours and
    whether the chunk holds the complete sum (what :func:`ring_explorer`'s page draws)."""
    if isinstance(max_world, bool) or not isinstance(max_world, int) or max_world < 2:
        raise ValueError(f"max_world must be a number of ranks of at least 2, got {max_world!r}")
    cmap = plt.get_cmap("Blues")
    out: dict[int, list[dict]] = {}
    for world in range(2, max_world + 1):
        frames = []
        for frame in ring_frames(world):
            cells = []
            for row in frame.holdings:
                cells.append([
                    [_label(who, world), to_hex(cmap(0.15 + 0.75 * len(who) / world)),
                     "#ffffff" if len(who) / world > 0.6 else "#000000", len(who) == world]
                    for who in row
                ])
            frames.append({"caption": frame.caption, "arrows": [list(a) for a in frame.arrows],
                           "cells": cells})
        out[world] = frames
    return out


_EXPLORER_JS = """
(function () {
  var root = document.getElementById("%(id)s");
  var data = %(data)s;
  var world = root.querySelector("input[name=ranks]");
  var step = root.querySelector("input[name=frame]");
  var svg = root.querySelector("svg"), caption = root.querySelector(".ring-explorer-caption");
  var S = 56, NS = "http://www.w3.org/2000/svg";
  function el(name, attrs, text) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function draw() {
    var n = +world.value, frames = data[n];
    step.max = frames.length - 1;
    if (+step.value > frames.length - 1) step.value = frames.length - 1;
    var f = frames[+step.value], h = 0.62, top = h + 0.6, left = -1.4;
    var width = (n * 1.25 + 0.3 - left) * S, height = (top + (n - 1) + 0.4) * S;
    var X = function (x) { return (x - left) * S; }, Y = function (y) { return (top - y) * S; };
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    svg.setAttribute("width", width); svg.setAttribute("height", height);
    svg.setAttribute("aria-label", "Ring all-reduce on " + n + " ranks, frame " + step.value +
                     " of " + (frames.length - 1) + ": " + f.caption);
    while (svg.lastChild && svg.lastChild.tagName !== "defs") svg.removeChild(svg.lastChild);
    for (var c = 0; c < n; c++)
      svg.appendChild(el("text", {x: X(c * 1.25 + 0.5), y: Y(h + 0.25), "text-anchor": "middle",
                                  "font-size": 12}, "chunk " + c));
    f.cells.forEach(function (row, r) {
      svg.appendChild(el("text", {x: X(-0.35), y: Y(-r + h / 2) + 4, "text-anchor": "end",
                                  "font-size": 13}, "rank " + r));
      row.forEach(function (cell, c) {
        svg.appendChild(el("rect", {x: X(c * 1.25), y: Y(-r + h), width: S, height: h * S,
                                    fill: cell[1], stroke: "#000",
                                    "stroke-width": cell[3] ? 2 : 0.8}));
        svg.appendChild(el("text", {x: X(c * 1.25 + 0.5), y: Y(-r + h / 2) + 4,
                                    "text-anchor": "middle", fill: cell[2],
                                    "font-size": n <= 4 ? 12 : n <= 6 ? 9 : 8}, cell[0]));
      });
    });
    f.arrows.forEach(function (a) {
      var x = a[2] * 1.25 + 0.5, d;
      if (a[1] === a[0] + 1)
        d = "M" + X(x + 0.18) + " " + Y(-a[0]) + " L" + X(x + 0.18) + " " + Y(-a[1] + h);
      else  // the wrap-around from the last rank to rank 0
        d = "M" + X(x + 0.42) + " " + Y(-a[0] + h / 2) + " Q" + X(x + 0.42 + 0.2 * n) + " " +
            Y((-a[0] + h) / 2) + " " + X(x + 0.42) + " " + Y(h / 2);
      svg.appendChild(el("path", {d: d, fill: "none", stroke: "#d62728", "stroke-width": 2.5,
                                  "marker-end": "url(#%(id)s-arrow)"}));
    });
    caption.textContent = "Frame " + step.value + " of " + (frames.length - 1) + ": " + f.caption;
    root.querySelector("output[name=ranks-shown]").textContent = n;
  }
  world.addEventListener("input", draw);
  step.addEventListener("input", draw);
  draw();
})();
"""


def ring_explorer(max_world: int = 8, world: int = 4):
    """The ring all-reduce explorer: two sliders, the number of ranks (2 to ``max_world``) and the
    frame, over the frames of :func:`ring_frames`, drawn as :func:`draw_ring_frame` draws them.

    It is a page of HTML and JavaScript with every frame in it, so the sliders work in a live
    notebook and on the static website alike, without a kernel (an ipywidgets explorer drew
    nothing new on the website). Returns an ``IPython.display.HTML``. Chapter 6."""
    # import here: IPython is the notebook's, not a dependency
    from IPython.display import HTML  # noqa: PLC0415

    frames = explorer_frames(max_world)
    if world not in frames:
        raise ValueError(f"world must be from 2 to max_world={max_world}, got {world!r}")
    uid = f"ring-explorer-{uuid.uuid4().hex[:8]}"
    script = _EXPLORER_JS % {"id": uid, "data": json.dumps(frames, separators=(",", ":"))}
    return HTML(
        f'<div id="{uid}" class="ring-explorer">'
        f'<label>ranks <input type="range" name="ranks" min="2" max="{max_world}" '
        f'value="{world}"></label> <output name="ranks-shown">{world}</output>'
        f'&nbsp;&nbsp;<label>frame <input type="range" name="frame" min="0" '
        f'max="{len(frames[world]) - 1}" value="0"></label>'
        f'<p class="ring-explorer-caption" aria-live="polite"></p>'
        f'<svg role="img" xmlns="http://www.w3.org/2000/svg" '
        f'style="max-width:100%;height:auto;font-family:sans-serif">'
        f'<defs><marker id="{uid}-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="5" '
        f'markerHeight="5" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        f'fill="#d62728"/></marker></defs></svg>'
        f"<script>{script}</script></div>"
    )


def plot_bytes_per_rank(
    world_sizes: Sequence[int],
    busiest: Mapping[str, Sequence[float]],
    formulas: Mapping[str, Callable[[int], float]],
) -> plt.Figure:
    """Gradients sent by the busiest rank against N: ``busiest[name]`` (counted, one dot per
    world size) and ``formulas[name]`` (a line over N = 2 to the largest world size), one colour
    per all-reduce."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = list(range(2, max(world_sizes) + 1))
    for name, values in busiest.items():
        colour = algorithm_colour(name)
        ax.plot(world_sizes, values, "o", color=colour, label=f"{name} (counted)")
        ax.plot(xs, [formulas[name](x) for x in xs], "-", color=colour, alpha=0.5)
    ax.set(
        xlabel="ranks N",
        ylabel="gradients sent by the busiest rank",
        title="Bytes sent per rank, ~1 MiB gradient (dots counted, lines formulas)",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    return fig
