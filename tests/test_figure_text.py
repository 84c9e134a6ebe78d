"""dpcourse.harness.figure_text: a figure's PNG records its smallest text (issue 34), which the
browser test turns into the text's size on the page (tests/test_browser.py)."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib.animation import FuncAnimation
from matplotlib.figure import Figure

from dpcourse.harness import figure_text

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def recording():
    figure_text.install()
    yield
    figure_text.uninstall()


def png_of(fig: Figure, **savefig) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format="png", **savefig)
    return out.getvalue()


def chart(dpi: float = 100) -> Figure:
    fig = Figure(figsize=(4, 3), dpi=dpi)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], label="ring")
    ax.set_xlabel("message size", fontsize=11)
    return fig


def test_the_smallest_text_is_a_legend_a_tick_label_or_a_note():
    fig = chart()
    assert figure_text.smallest_text_pt(fig) == 10  # matplotlib's tick labels, before a draw
    fig.axes[0].legend(fontsize=8)
    assert figure_text.smallest_text_pt(fig) == 8
    fig.axes[0].text(0.5, 0.5, "note", fontsize=6.5)
    assert figure_text.smallest_text_pt(fig) == 6.5
    fig.axes[0].tick_params(labelsize=5)
    assert figure_text.smallest_text_pt(fig) == 5


def test_text_that_is_not_drawn_does_not_count():
    fig = chart()
    ax = fig.axes[0]
    ax.tick_params(labelsize=5)
    ax.axis("off")  # the tick labels go; the axis label is an axis' too
    ax.set_title("a title", fontsize=12)
    assert figure_text.smallest_text_pt(fig) == 12
    ax.text(0, 0, "", fontsize=4)  # empty
    ax.text(0, 0, "hidden", fontsize=4, visible=False)
    assert figure_text.smallest_text_pt(fig) == 12
    hidden = fig.add_axes((0, 0, 0.1, 0.1))
    hidden.set_title("gone", fontsize=3)
    hidden.set_visible(False)
    assert figure_text.smallest_text_pt(fig) == 12
    assert figure_text.smallest_text_pt(Figure()) is None


def test_installed_every_png_records_it_and_its_resolution(recording):
    fig = chart(dpi=100)
    fig.axes[0].legend(fontsize=7)
    plain = figure_text.read(png_of(fig))
    assert (plain.smallest_pt, plain.dpi, plain.width) == (7, 100, 400)
    assert plain.smallest_px == pytest.approx(7 * 100 / 72)
    tight = figure_text.read(png_of(fig, bbox_inches="tight", dpi=150))  # as the inline backend
    assert (tight.smallest_pt, tight.dpi) == (7, 150) and tight.width < 600
    # an animation's frames, as to_jshtml puts them on the page (a data: URI each)
    (line,) = fig.axes[0].plot([0, 1], [0, 0])
    html = FuncAnimation(fig, lambda i: line.set_ydata([0, i]), frames=2).to_jshtml()
    start = html.index("data:image/png;base64,")
    frame = figure_text.read(html[start : start + 1000])  # the start of the URI is enough
    assert frame.smallest_pt == 7 and frame.dpi == fig.dpi


def test_without_install_a_png_records_no_text_size():
    text = figure_text.read(png_of(chart()))
    assert text.smallest_pt is None and text.smallest_px is None and text.dpi == 100


def test_reading_something_else_says_what_it_is():
    with pytest.raises(ValueError, match="not a PNG"):
        figure_text.read(b"GIF89a")
    with pytest.raises(ValueError, match="not a base64 PNG data URI"):
        figure_text.read("data:image/gif;base64," + base64.b64encode(b"GIF89a").decode())


def test_the_notebooks_kernels_install_it_through_pythonstartup():
    """tools/notebook_startup.py, as IPython runs PYTHONSTARTUP in a kernel: it installs the
    recording and leaves no name of its own in the notebook's namespace."""
    code = (
        "import runpy, matplotlib.backends.backend_agg as agg\n"
        "names = runpy.run_path(sys.argv[1], run_name='__main__')\n"
        "own = sorted(n for n in names if not n.startswith('__'))\n"
        "print(agg.FigureCanvasAgg.print_png.__name__, own)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, str(ROOT / "tools" / "notebook_startup.py")],
        capture_output=True, text=True, check=True, env={**os.environ, "MPLBACKEND": "agg"},
    )
    assert out.stdout.split() == ["_print_png_recording_text", "[]"], out.stdout + out.stderr
    assert "notebook_startup.py" in (ROOT / "Makefile").read_text()


# --- Issue 45: a legend over data or text, a text cut at the edge --------------------------------
def test_a_legend_over_a_label_or_a_line_and_a_cut_text_are_found():
    fig = Figure(figsize=(4, 3), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0, 1], [0.5, 0.5], label="ring")
    ax.set(ylabel="a label", title="chart")
    ax.legend(loc="center")  # over the line
    assert figure_text.layout_problems(fig) == ["the legend of 'chart' covers the line 'ring'"]
    ax.legend(loc="center left", bbox_to_anchor=(-0.3, 0.5))  # over the y label instead
    assert "covers the text 'a label'" in figure_text.layout_problems(fig)[0]
    ax.legend(loc="lower left")
    assert figure_text.layout_problems(fig) == []
    fig.text(0.95, 0.5, "a note that runs past the edge")
    assert figure_text.layout_problems(fig) == [
        "the text 'a note that runs past the edge' is cut by the figure's edge"]


def test_the_png_records_what_the_layout_hides(recording):
    fig = Figure(figsize=(4, 3), dpi=100)
    ax = fig.add_subplot()
    ax.bar([0, 1], [1, 2], label="bars")
    ax.legend(loc="upper left", bbox_to_anchor=(0.6, 1))
    recorded = figure_text.read(png_of(fig, bbox_inches="tight"))
    assert recorded.layout_problems and "covers a bar" in recorded.layout_problems[0]
    ax.legend(loc="upper left")
    assert figure_text.read(png_of(fig)).layout_problems == ()
