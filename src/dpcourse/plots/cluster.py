"""The all-reduces over emulated network links, beside the alpha-beta model (section 6.7).

Chapter 6 times the naive, tree and ring all-reduce on 2, 4 and 8 emulated machines with
:func:`dpcourse.harness.bench.cluster.measure_on_cluster`, one result per node count, each
set beside the model's with alpha and beta fitted from ping-pong messages over one link.
:func:`plot_cluster_runs` draws time and bus bandwidth against N at the largest size,
:func:`cluster_table` and :func:`model_errors` put numbers on them
(:func:`dpcourse.harness.bench.cluster.recorded_runs` finds the runs recorded in
``benchmarks/`` for a build that cannot make a cluster).

Chapter 6: the all-reduces measured over emulated links.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Mapping

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from dpcourse.collectives.commbench import bus_bandwidth
from dpcourse.cost.hardware import rate_bits
from dpcourse.plots import algorithm_colour

__all__ = ["machine_line", "model_errors", "cluster_table",
           "plot_cluster_runs"]

MODEL = "alpha-beta model (alpha, beta fitted from ping-pong)"


def machine_line(machine) -> str:
    """A :class:`dpcourse.runtime.Machine`, or the ``machine`` of a recorded JSON, in words."""
    m = dataclasses.asdict(machine) if dataclasses.is_dataclass(machine) else dict(machine)
    gpus = ", ".join(m["gpus"]) if m["gpus"] else "no GPU"
    return f"{m['cpus']} CPU cores, {gpus}, torch {m['torch_version']}"


def model_errors(runs: Mapping[int, Mapping], smallest: int = 0) -> list[tuple]:
    """``(N, algorithm, size, measured / model - 1)`` for every size of at least ``smallest``
    bytes, in the order of the runs, algorithms and sizes."""
    return [(n, name, size, measured / model - 1)
            for n, run in runs.items()
            for name in run["measured"]
            for size, measured, model in zip(run["sizes"], run["measured"][name],
                                             run["model"][name], strict=True)
            if size >= smallest]


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def cluster_table(runs: Mapping[int, Mapping], flag: float = 0.2, smallest: int = 2**20) -> str:
    """Measured milliseconds, the model's in brackets and the model's error, per N, size and
    algorithm; a ``*`` marks errors over ``flag`` at ``smallest`` bytes or more."""
    lines = []
    for n, run in runs.items():
        names = list(run["measured"])
        lines.append(f"{n} nodes: alpha {run['alpha'] * 1e6:.0f} us, beta "
                     f"{run['beta'] * 8 / 1e6:.0f} Mbit/s (fitted from ping-pong)")
        heads = [f"{name} ms (model) err" for name in names]
        lines.append(f"{'size':>8}" + "".join(f"{h:>22}" for h in heads))
        for i, size in enumerate(run["sizes"]):
            cells = []
            for name in names:
                t, m = run["measured"][name][i], run["model"][name][i]
                mark = "*" if size >= smallest and abs(t / m - 1) > flag else " "
                cells.append(f"{t * 1e3:.1f} ({m * 1e3:.1f}) {(t / m - 1) * 100:+4.0f}%{mark}")
            lines.append(f"{_size(size):>8}" + "".join(f"{c:>22}" for c in cells))
    lines.append(f"(medians; * the model is off by more than {flag * 100:g} % at "
                 f"{_size(smallest)} or more)")
    return "\n".join(lines)


def _rate(link: str) -> str:
    bits = rate_bits(link)
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def _some_minor(value: float, _) -> str:  # on a log axis: 20, 50, 200, 500 but not 30, 40, ...
    return f"{value:g}" if f"{value:e}"[0] in "25" else ""


def plot_cluster_runs(runs: Mapping[int, Mapping], source: str = "") -> plt.Figure:
    """Time (log scale) and bus bandwidth against N at the largest size of the runs
    (``{N: measure_on_cluster's result}``, the same sizes and link in each): the measured
    times as dots, the model's as lines of the same colour, the link's rate for reference."""
    ns = sorted(runs)
    first = runs[ns[0]]
    size, link = first["sizes"][-1], _rate(first["link"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 3.7), layout="constrained")
    for name in first["measured"]:
        for kind, style in (("measured", "o"), ("model", "-")):
            times = [runs[n][kind][name][-1] for n in ns]
            busbw = [bus_bandwidth(size, t, n) * 8 / 1e9 for t, n in zip(times, ns, strict=True)]
            label = name if kind == "measured" else None
            ax1.plot(ns, [t * 1e3 for t in times], style, color=algorithm_colour(name),
                     label=label)
            ax2.plot(ns, busbw, style, color=algorithm_colour(name), label=label)
    ax2.axhline(rate_bits(first["link"]) / 1e9, color="grey", ls=":", label=f"link rate ({link})")
    ax1.set(yscale="log", ylabel="milliseconds per all-reduce",
            title=f"Time of one all-reduce of {_size(size)}")
    ax2.set(ylim=(0, None), ylabel="bus bandwidth (Gbit/s)",
            title="Bus bandwidth = size / time x 2(N-1)/N")
    ax1.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 100, not 10^2
    ax1.yaxis.set_minor_formatter(FuncFormatter(_some_minor))
    for ax in (ax1, ax2):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("nodes N (one rank each)")
        ax.grid(alpha=0.3)
    # The algorithms only: the title says dots are measured and lines the model (with the
    # model's name, the left legend covered the naive all-reduce's points). One legend under
    # both panels: inside them it covered a line on one run or another.
    fig.legend(*ax2.get_legend_handles_labels(), fontsize=9, loc="outside lower center",
               ncols=4)
    # Each line wrapped to the figure's 8.4 inches (a 12 pt character is about 7 points wide):
    # on one line the title was 10.4 inches, and the PNG, cut to fit it, showed its 9 pt labels
    # at 8.4 px on the page (the browser test's figure check).
    title = [f"All-reduce on emulated {link} links: measured (dots) against the {MODEL}", source]
    fig.suptitle("\n".join(textwrap.fill(line, 84) for line in title if line))
    return fig
