"""How small the text of the book's figures is, recorded in each figure's PNG (issue 34).

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

Chapter 0: the course's tooling (the website's checks).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from PIL import Image, UnidentifiedImageError

_KEY = "dpcourse:smallest-text-pt"
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


def _print_png_recording_text(self, filename_or_obj, *, metadata=None, pil_kwargs=None, **_):
    """FigureCanvasAgg.print_png, with the figure's smallest text size in the PNG's metadata.
    ``**_``: what print_figure passes every backend (dpi, orientation, ...), which matplotlib
    drops before calling its own print_png but not before calling a function of another module."""
    pt = smallest_text_pt(self.figure)
    if pt is not None:
        metadata = {**(metadata or {}), _KEY: f"{pt:g}"}
    return _ORIGINAL_PRINT_PNG(self, filename_or_obj, metadata=metadata, pil_kwargs=pil_kwargs)


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
    return FigureText(smallest_pt=float(pt) if pt is not None else None,
                      dpi=round(dpi[0], 1) if dpi else None, width=image.width)
