"""How small the text of the book's figures is, and what their legends cover, recorded in each
figure's PNG (issues 34 and 45).

A figure's labels drawn at 9 pt are readable at the figure's own size and not at half of it: a
page that shrinks a wide figure to fit its column shrinks the text with it (chapter 6's two-panel
figures once showed their legends at about 6 pixels). The browser test (``tests/test_browser.py``)
measures the text as a learner sees it: the figure's smallest font in the PNG's own pixels, times
the scale the page shows the PNG at. Only the kernel that drew the figure knows the first number,
so :func:`install` makes matplotlib write it into every PNG it saves, as a text chunk (:data:`_KEY`,
in points) beside the resolution PNG always carries (its ``pHYs`` chunk); :func:`read` gets both
back. ``tools/notebook_startup.py`` installs it in the kernels that execute the book's notebooks
(``make notebooks`` and ``make book`` name it in ``PYTHONSTARTUP``); a learner's kernel is left
alone.

The same kernel knows where each legend, label and bar ended up, which the PNG's pixels no longer
say: :func:`layout_problems` lists a legend drawn over its axes' data (a line, a bar, a point, a
bar's label) or over any text of the figure (an axis label, a tick label, a title: chapter 7's
bar chart once hid the top tick and cut its y label to "ms per training step (media"), and a text
cut by the figure's edge. The PNG records them too (:data:`_LAYOUT_KEY`), and the browser test
fails the page that shows such a figure.

Chapter 0: the course's tooling (the website's checks).
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass

import matplotlib.image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from matplotlib.transforms import Bbox
from PIL import Image, UnidentifiedImageError

_KEY = "dpcourse:smallest-text-pt"
_LAYOUT_KEY = "dpcourse:layout-problems"
_POINTS_PER_INCH = 72
_ORIGINAL_PRINT_PNG = FigureCanvasAgg.print_png


@dataclass(frozen=True)
class FigureText:
    """What a PNG says about its text: the smallest font in points (None where the figure was
    saved without :func:`install`), its resolution in dots per inch (None where it has no
    ``pHYs`` chunk) and its width in pixels."""

    smallest_pt: float | None
    dpi: float | None
    width: int
    layout_problems: tuple[str, ...] = ()

    @property
    def smallest_px(self) -> float | None:
        """The smallest text's size in the PNG's own pixels (a 9 pt label at 100 dpi: 12.5)."""
        if self.smallest_pt is None or self.dpi is None:
            return None
        return self.smallest_pt * self.dpi / _POINTS_PER_INCH


def smallest_text_pt(fig: Figure) -> float | None:
    """The size in points of the smallest text ``fig`` draws: titles, axis labels, tick labels,
    legends, annotations (None when it draws no text). The axes' texts of an axes turned off
    (``ax.axis("off")``: tick labels, axis labels) and every text of a hidden axes are not drawn,
    and do not count."""
    hidden: set[int] = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            # tick labels get their text from the axis' formatter only when asked (or drawn)
            axis.get_majorticklabels()
            axis.get_minorticklabels()
            if not ax.axison:
                hidden.update(id(text) for text in axis.findobj(Text))
        if not ax.get_visible():
            hidden.update(id(text) for text in ax.findobj(Text))
    sizes = [
        text.get_fontsize()
        for text in fig.findobj(Text)
        if text.get_visible() and text.get_text().strip() and id(text) not in hidden
    ]
    return min(sizes) if sizes else None


def _shown_texts(fig: Figure) -> list[Text]:
    """The texts the figure draws: not a legend's own, not an axes' turned off, not the labels of
    ticks outside the axes' view (matplotlib keeps them, and does not draw them)."""
    hidden: set[int] = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            scale = axis.get_transform()  # compare on the axis' scale (log, linear...)
            low, high = sorted(scale.transform(axis.get_view_interval()))
            slack = 1e-9 * (high - low)
            drawn = set()  # as Axis._update_ticks picks them: one per location, in the view
            for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks),
                                (axis.get_minorticklocs(), axis.get_minor_ticks)):
                where = scale.transform(locs) if len(locs) else locs
                drawn.update(id(label) for tick, at in zip(ticks(len(locs)), where, strict=True)
                             if low - slack <= at <= high + slack
                             for label in (tick.label1, tick.label2))
            hidden.update(id(label) for tick in axis.get_major_ticks() + axis.get_minor_ticks()
                          for label in (tick.label1, tick.label2) if id(label) not in drawn)
        if not ax.axison:
            hidden.update(id(text) for axis in (ax.xaxis, ax.yaxis) for text in axis.findobj(Text))
        if not ax.get_visible():
            hidden.update(id(text) for text in ax.findobj(Text))
    legends = [text for legend in fig.findobj(Legend) for text in legend.findobj(Text)]
    hidden.update(id(text) for text in legends)
    return [text for text in fig.findobj(Text)
            if text.get_visible() and text.get_text().strip() and id(text) not in hidden]


def _covered_data(legend: Legend, box: Bbox, renderer) -> list[str]:
    """What of its axes' data a legend drawn in ``box`` (display coordinates) covers."""
    ax = legend.axes
    if ax is None:  # a figure's legend: the data of every axes
        axes = legend.figure.axes
    else:
        axes = [ax]
    found = []
    for each in axes:
        for line in each.lines:
            if not line.get_visible():
                continue
            path = line.get_transform().transform_path(line.get_path())
            if box.count_contains(path.vertices) or path.intersects_bbox(box, filled=False):
                found.append(f"the line {line.get_label()!r}")
        for patch in each.patches:
            if isinstance(patch, Rectangle) and patch.get_visible() and patch.get_height():
                extent = patch.get_bbox().transformed(patch.get_data_transform())
                if extent.width > 0 and extent.height > 0 and box.overlaps(extent):
                    found.append(f"a bar ({patch.get_label() or 'unlabelled'})")
        for collection in each.collections:
            offsets = collection.get_offsets()
            if collection.get_visible() and len(offsets):
                points = collection.get_offset_transform().transform(offsets)
                if box.count_contains(points):
                    found.append(f"the points {collection.get_label()!r}")
    return list(dict.fromkeys(found))


def layout_problems(fig: Figure, renderer=None) -> list[str]:
    """What the figure's layout hides: a legend over data of its axes or over a text of the figure
    (axis labels, tick labels, titles, bars' labels), and texts cut by the figure's edge. Pass the
    ``renderer`` the figure was just drawn with (as it is saved); without one, the figure is drawn
    on an Agg canvas first."""
    if renderer is None:
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
    problems = []
    edge = fig.bbox
    texts = _shown_texts(fig)
    for text in texts:
        e = text.get_window_extent(renderer)
        # cut: a fifth of it or more past an edge (a descender's pixel or two is not)
        past_x = max(0.0, edge.x0 - e.x0) + max(0.0, e.x1 - edge.x1)
        past_y = max(0.0, edge.y0 - e.y0) + max(0.0, e.y1 - edge.y1)
        if e.width and (past_x > 0.2 * e.width or past_y > 0.2 * e.height):
            problems.append(f"the text {text.get_text()!r} is cut by the figure's edge")
    for legend in fig.findobj(Legend):
        if not legend.get_visible():
            continue
        box = legend.get_window_extent(renderer)
        covered = _covered_data(legend, box, renderer)
        covered += [f"the text {text.get_text()!r}" for text in texts
                    if box.overlaps(text.get_window_extent(renderer))]
        if covered:
            where = legend.axes.get_title() if legend.axes is not None else "the figure"
            problems.append(f"the legend of {where or 'an axes'!r} covers "
                            + ", ".join(covered[:4]) + (" and more" if len(covered) > 4 else ""))
    return problems


def _print_png_recording_text(self, filename_or_obj, *, metadata=None, pil_kwargs=None, **_):
    """FigureCanvasAgg.print_png, with the figure's smallest text size and its layout problems in
    the PNG's metadata. ``**_``: what print_figure passes every backend (dpi, orientation, ...),
    which matplotlib drops before calling its own print_png but not before calling a function of
    another module."""
    pt = smallest_text_pt(self.figure)
    if pt is not None:
        metadata = {**(metadata or {}), _KEY: f"{pt:g}"}
    # What the original does (FigureCanvasAgg._print_pil: draw, then save the buffer), with the
    # layout read from that one drawing in between.
    FigureCanvasAgg.draw(self)
    problems = layout_problems(self.figure, self.get_renderer())
    if problems:
        metadata = {**(metadata or {}), _LAYOUT_KEY: json.dumps(problems)}
    matplotlib.image.imsave(filename_or_obj, self.buffer_rgba(), format="png", origin="upper",
                            dpi=self.figure.dpi, metadata=metadata, pil_kwargs=pil_kwargs)


def install() -> None:
    """Make every PNG matplotlib saves in this process record its figure's smallest text (the
    inline backend's figures, ``savefig`` and the frames of ``Animation.to_jshtml`` alike)."""
    FigureCanvasAgg.print_png = _print_png_recording_text


def uninstall() -> None:
    """Undo :func:`install`."""
    FigureCanvasAgg.print_png = _ORIGINAL_PRINT_PNG


def read(png: bytes | str) -> FigureText:
    """What a PNG records about its text. ``png``: the file's bytes, or a ``data:image/png;base64,``
    URI as a page holds an animation's frame (its start is enough: PNG puts the metadata and the
    resolution before the pixels, and Pillow reads them without the pixels)."""
    if isinstance(png, str):
        head, _, data = png.partition("base64,")
        if not head.startswith("data:image/png"):
            raise ValueError(f"not a base64 PNG data URI: {png[:40]!r}")
        data = "".join(data.split())
        data = data[: len(data) // 4 * 4]  # a cut-off URI: whole 4-character groups only
        png = base64.b64decode(data)
    try:
        image = Image.open(io.BytesIO(png))
    except UnidentifiedImageError:
        image = None
    if image is None or image.format != "PNG":
        raise ValueError("not a PNG: it lacks the PNG signature")
    pt = image.info.get(_KEY)
    dpi = image.info.get("dpi")  # from the pHYs chunk, in dots per inch (99.9998 for 100)
    layout = tuple(json.loads(image.info.get(_LAYOUT_KEY, "[]")))
    return FigureText(smallest_pt=float(pt) if pt is not None else None,
                      dpi=round(dpi[0], 1) if dpi else None, width=image.width,
                      layout_problems=layout)
