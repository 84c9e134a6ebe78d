"""Plots of chapter 9: memory per rank under ZeRO, the optimizer state each rank holds, a
timeline of FSDP's gathers, compute and reduce-scatters, who holds what at each stage (from the
bytes each rank's tensors hold, :func:`plot_holdings`), and FSDP's layers gathered and freed over
a step (from the step's recorded events, :func:`fsdp_gather_animation`).

Each function takes what the chapter has already computed (bytes per rank from
:func:`~dpcourse.sharding.zero_memory.zero_memory_per_rank`, state bytes measured by
:func:`~dpcourse.harness.bench.zero.train_variants_on_rank`), draws them on a new figure, returns
the figure and never calls ``plt.show``. Nothing here trains or measures.

Chapter 9: plots of ZeRO's memory per rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib import animation
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

__all__ = ["fsdp_gather_animation", "plot_fsdp_timeline", "plot_holdings",
           "plot_memory_per_rank", "plot_state_per_rank"]

# Forward and backward in two colours a reader tells apart (they were two similar greys), the
# collectives in the colours of the ring's phases.
_FSDP_COLOURS = {"all-gather": "tab:blue", "forward": "#8172b3", "backward": "#4d4d4d",
                 "reduce-scatter": "tab:orange"}


def plot_memory_per_rank(
    world_sizes: Sequence[int],
    bytes_per_rank: Mapping[str, Sequence[float]],
    title: str,
    gpu_bytes: float | None = 80 * 2**30,
) -> Figure:
    """Bytes per rank of the model states against the number of ranks, both axes logarithmic,
    in GB (10⁹ bytes): one line with dots per entry of ``bytes_per_rank`` (``{label: bytes for
    each world size}``, e.g. data parallelism and ZeRO stages 1 to 3), and a dashed line at
    ``gpu_bytes``, the memory of one GPU (none when ``None``). Chapter 9, section 9.2."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, values in bytes_per_rank.items():
        ax.plot(world_sizes, [v / 1e9 for v in values], "o-", label=label)
    if gpu_bytes is not None:
        ax.axhline(gpu_bytes / 1e9, color="grey", ls="--", lw=1)
        ax.text(max(world_sizes) * 0.29, gpu_bytes / 1e9 * 0.78,
                f"one {gpu_bytes / 2**30:g} GiB GPU", color="grey", fontsize=9)
    ax.set(xscale="log", yscale="log", xlabel="ranks N", ylabel="GB per rank (model states)",
           title=title)
    ax.set_xticks(world_sizes, [str(n) for n in world_sizes])
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def plot_state_per_rank(
    state_per_rank: Mapping[int, Mapping[str, Sequence[int]]],
    unsharded: int,
    num_params: int,
) -> Figure:
    """Optimizer state held by each rank as a fraction of the ``unsharded`` state: one panel per
    world size N of ``state_per_rank`` (``{N: {optimizer name: bytes of rank 0, 1, ...}}``),
    side by side bars per optimizer for each rank, and a dashed line at the even share 1/N.
    ``num_params`` goes in the title. Chapter 9, section 9.6."""
    width = min(8.4, 3 * len(state_per_rank))  # the book's column: labels keep their size
    fig, axes = plt.subplots(1, len(state_per_rank), figsize=(width, 3.7), sharey=True,
                             layout="constrained", squeeze=False)
    for ax, (n, by_name) in zip(axes[0], state_per_rank.items(), strict=True):
        width = 0.76 / len(by_name)
        for k, (name, values) in enumerate(by_name.items()):
            offset = (k - (len(by_name) - 1) / 2) * width
            ax.bar([r + offset for r in range(n)], [v / unsharded for v in values], width,
                   label=name)
        ax.axhline(1 / n, color="black", lw=1, ls="--")
        ax.set(title=f"N = {n}", xlabel="rank", xticks=range(n))
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].set_ylabel("optimizer state / unsharded")
    # under the panels: inside the first, it covered a bar
    fig.legend(*axes[0, 0].get_legend_handles_labels(), fontsize=9, loc="outside lower center",
               ncols=len(next(iter(state_per_rank.values()))))
    fig.suptitle(f"Adam state per rank, measured (dashed: 1/N); {num_params:,} parameters")
    return fig


def plot_fsdp_timeline(timelines: Mapping[str, Sequence[tuple[str, str, float, float]]],
                       title: str) -> Figure:
    """One panel per recorded step (e.g. ``{"prefetch=True": events, ...}`` from
    :func:`~dpcourse.harness.bench.fsdp.timeline_on_rank`): a row per layer, with its all-gathers,
    forward and backward compute and reduce-scatter as bars, and the end of the step (the
    gradients synchronised) as a dotted line. Chapter 9."""
    layers = sorted({e[0] for t in timelines.values() for e in t if e[0] != "step"}, key=str)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(8, 1.4 + 1.1 * len(layers)),
                             sharex=True, layout="constrained", squeeze=False)
    for ax, (name, events) in zip(axes[:, 0], timelines.items(), strict=True):
        seen = set()
        for layer, kind, start, end in events:
            if layer == "step":
                ax.axvline(end * 1e3, ls=":", color="k")
                ax.set_title(f"{name}: gradients synchronised after {end * 1e3:.1f} ms",
                             fontsize=9, loc="left")
                continue
            if kind not in _FSDP_COLOURS:  # instants such as "queued"
                continue
            row = layers.index(layer)
            comm = kind in ("all-gather", "reduce-scatter")
            ax.barh(row + (0.2 if comm else -0.2), (end - start) * 1e3, left=start * 1e3,
                    height=0.35, color=_FSDP_COLOURS[kind],
                    label=None if kind in seen else kind)
            seen.add(kind)
        ax.set_yticks(range(len(layers)), [f"layer {n}" for n in layers])
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("time since the step began (ms)")
    # One legend under the panels: inside each, it covered the last layer's row.
    handles = {}
    for ax in axes[:, 0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    kinds = [k for k in _FSDP_COLOURS if k in handles]
    fig.legend([handles[k] for k in kinds], kinds, fontsize=9, loc="outside lower center",
               ncols=4)
    fig.suptitle(title, fontsize=9)
    return fig


_GPU_COLOURS = {"matmul": "tab:blue", "copy": "tab:orange", "NCCL kernel": "tab:green",
                "other kernel": "tab:gray"}


def _stream_label(row: str) -> str:
    """A trace row's label: "compute stream", "all-gather stream", "NCCL's stream 7"..."""
    if row.startswith("NCCL "):
        return f"NCCL's stream {row.split()[1]}"
    return row if row.startswith("stream ") else f"{row} stream"


def plot_stream_trace(trace: dict, title: str) -> Figure:
    """The GPU's work during one FSDP step, a row per CUDA stream (the compute stream, then the
    communication thread's all-gather and reduce-scatter streams, then any other: NCCL's own,
    where its kernels run), each kernel or copy a bar coloured by kind, from
    :func:`~dpcourse.harness.bench.fsdp_streams.stream_trace_on_rank`. Chapter 9."""
    rows = list(dict.fromkeys(["compute", "all-gather", "reduce-scatter",
                               *(e[0] for e in trace["events"])]))
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.55 * len(rows)), layout="constrained")
    seen = set()
    # A kernel of a few microseconds in a step of tens of milliseconds is under a pixel wide:
    # every bar is drawn at least 1/300 of the step, so that each shows where it ran.
    span = max((e[4] for e in trace["events"]), default=0.0) - min(
        (e[3] for e in trace["events"]), default=0.0)
    shortest = span / 300
    for row, kind, _, start, end in trace["events"]:
        ax.barh(rows.index(row), max(end - start, shortest) * 1e3, left=start * 1e3, height=0.6,
                color=_GPU_COLOURS.get(kind, "tab:gray"), label=None if kind in seen else kind)
        seen.add(kind)
    ax.set_yticks(range(len(rows)), [_stream_label(r) for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time since the step's first GPU work (ms)")
    fig.legend(fontsize=9, loc="outside lower center", ncol=3)  # off the bars
    ax.set_title(title, fontsize=9, loc="left")
    return fig


# Who holds what: one colour per part of the training state, as chapter 1's memory breakdown.
_PARTS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868"}
_STAGES = {0: "plain data parallelism", 1: "ZeRO-1: optimizer state sharded",
           2: "ZeRO-2: + gradients", 3: "ZeRO-3 / FSDP: + parameters"}


def plot_holdings(held_by_rank: Sequence[Mapping[int, Mapping[str, int]]]) -> Figure:
    """Who holds what at each ZeRO stage: a row per stage, a panel per rank, and in each a bar
    per part of the training state (parameters, gradients, optimizer state) as long as the whole
    model's, filled over what the rank holds: the whole bar where it holds all of it, its own
    slice (rank r's r-th) where it holds a shard; a label gives the share. ``held_by_rank[r]``
    is rank r's ``{stage: {part: bytes}}`` as counted on its tensors after a step (stage 0's
    bytes are the whole model's). Chapter 9."""
    world = len(held_by_rank)
    stages = sorted(held_by_rank[0])
    fig, axes = plt.subplots(len(stages), world, figsize=(8.4, 0.45 + 0.95 * len(stages)),
                             sharex=True, layout="constrained", squeeze=False)
    for row, stage in enumerate(stages):
        for rank in range(world):
            ax = axes[row, rank]
            for k, (part, colour) in enumerate(_PARTS.items()):
                whole = held_by_rank[rank][stages[0]][part]
                share = held_by_rank[rank][stage][part] / whole
                y = len(_PARTS) - 1 - k
                ax.add_patch(Rectangle((0, y - 0.35), 1, 0.7, facecolor="white",
                                       edgecolor="#999999", lw=0.6))
                sharded = share < 0.75
                left, width = (rank / world, min(share, 1.0)) if sharded else (0, min(share, 1))
                ax.add_patch(Rectangle((left, y - 0.35), width, 0.7, facecolor=colour))
                ax.text(1.02, y, f"{share:.0%}", va="center", fontsize=9)
            ax.set(xlim=(0, 1.25), ylim=(-0.6, len(_PARTS) - 0.4))
            ax.set_yticks(range(len(_PARTS)),
                          [p.replace("_", " ") for p in reversed(_PARTS)] if rank == 0 else [])
            ax.set_xticks([])
            ax.tick_params(labelsize=9, length=0)
            for side in ("top", "right", "bottom", "left"):
                ax.spines[side].set_visible(False)
            if row == 0:  # at the right: the stage's name is at the left
                ax.set_title(f"rank {rank}", fontsize=10, loc="right")
        axes[row, 0].annotate(_STAGES.get(stage, f"stage {stage}"), (0, 1),
                              xycoords="axes fraction", fontsize=9, fontweight="bold",
                              va="bottom")
    fig.suptitle("Who holds what after one step, counted on each rank's tensors "
                 "(bar: the whole model's; filled: what this rank holds)", fontsize=10)
    return fig


def _gathered_over_step(events: Sequence[tuple[str, str, float, float]]) -> list[dict]:
    """From a step's recorded events (``(layer, kind, start, end)``, as
    :func:`plot_fsdp_timeline` takes them): the frames of the layers gathered over the step. A
    layer is gathered from the end of an all-gather until the end of the compute it was gathered
    for (forward: freed after the layer's forward; backward: after its reduce-scatter starts),
    sharded otherwise."""
    layers = sorted({e[0] for e in events if e[0] != "step"}, key=str)
    spans: dict[str, list[tuple[float, float, str]]] = {layer: [] for layer in layers}
    for layer in layers:
        own = sorted((e for e in events if e[0] == layer), key=lambda e: e[2])
        gathers = [e for e in own if e[1] == "all-gather"]
        for gather, (kind, until) in zip(gathers, (("forward", "forward"),
                                                   ("backward", "reduce-scatter")), strict=False):
            ends = [e[2] if until == "reduce-scatter" else e[3]
                    for e in own if e[1] == until and e[2] >= gather[2]]
            if ends:
                spans[layer].append((gather[3], ends[0], kind))
    times = sorted({t for spans_ in spans.values() for a, b, _ in spans_ for t in (a, b)})
    frames = [{"at": 0.0, "gathered": {layer: None for layer in layers},
               "caption": "the step starts: every layer holds only its shard"}]
    for t in times:
        gathered = {layer: next((kind for a, b, kind in spans[layer] if a <= t < b), None)
                    for layer in layers}
        changed = [layer for layer in layers if gathered[layer] != frames[-1]["gathered"][layer]]
        if not changed:
            continue
        what = ", ".join(
            f"layer {layer} " + (f"gathered for {gathered[layer]}" if gathered[layer] else "freed")
            for layer in changed)
        frames.append({"at": t, "gathered": gathered, "caption": f"{t * 1e3:.1f} ms: {what}"})
    return frames


def fsdp_gather_animation(events: Sequence[tuple[str, str, float, float]], world: int,
                          title: str, interval_ms: int = 900) -> animation.FuncAnimation:
    """FSDP's layers over one step, from its recorded events (:func:`_gathered_over_step`): a
    row per layer, its parameters' rows as a bar, this rank's shard (1/``world`` of the rows)
    always filled, the whole bar filled while the layer is gathered (for forward or for backward)
    and emptied again when it is freed. ``.to_jshtml()`` plays it on a static page. Chapter 9."""
    frames = _gathered_over_step(events)
    layers = list(frames[0]["gathered"])
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.5 * len(layers)), layout="constrained")
    colours = {"forward": _FSDP_COLOURS["forward"], "backward": _FSDP_COLOURS["backward"]}

    def draw(i: int) -> None:
        frame = frames[i]
        ax.clear()
        for row, layer in enumerate(layers):
            y = len(layers) - 1 - row
            kind = frame["gathered"][layer]
            ax.add_patch(Rectangle((0, y - 0.35), 1, 0.7, facecolor="white",
                                   edgecolor="black", lw=0.8))
            if kind:
                ax.add_patch(Rectangle((0, y - 0.35), 1, 0.7, facecolor=colours[kind],
                                       alpha=0.55))
            ax.add_patch(Rectangle((0, y - 0.35), 1 / world, 0.7,
                                   facecolor=_FSDP_COLOURS["all-gather"]))
            ax.text(-0.01, y, f"layer {layer}", ha="right", va="center", fontsize=10)
            ax.text(1.01, y, f"gathered for {kind}" if kind else "its shard only", ha="left",
                    va="center", fontsize=10)
        ax.set(xlim=(-0.17, 1.3), ylim=(-0.7, len(layers) - 0.3))
        ax.axis("off")
        ax.set_title(f"{title}\n{frame['caption']}", fontsize=10)

    draw(0)
    fig.legend(handles=[Patch(facecolor=_FSDP_COLOURS["all-gather"], label="this rank's shard"),
                        Patch(facecolor=colours["forward"], alpha=0.55,
                              label="gathered for forward"),
                        Patch(facecolor=colours["backward"], alpha=0.55,
                              label="gathered for backward")],
               loc="outside lower center", ncols=3, fontsize=9)
    anim = animation.FuncAnimation(fig, draw, frames=len(frames), interval=interval_ms)
    plt.close(fig)
    return anim
