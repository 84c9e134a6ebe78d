"""How small the text of the book's figures is, recorded in each figure's PNG (issue 34).

A figure's labels drawn at 9 pt are readable at the figure's own size and not at half of it: a
page that shrinks a wide figure to fit its column shrinks the text with it (chapter 6's two-panel
figures once showed their legends at about 6 pixels). The browser test (``tests/test_browser.py``)
measures the text as a learner sees it: the figure's smallest font in the PNG's own pixels, times
the scale the page shows the PNG at. Only the kernel that drew the figure knows the first number,
so :func:`install` makes matplotlib write it into every PNG it saves, as a text chunk (:data:`KEY`,
in points) beside the resolution PNG always carries (its ``pHYs`` chunk); :func:`read` gets both
back. ``tools/notebook_startup.py`` installs it in the kernels that execute the book's notebooks
(``make notebooks`` and ``make book`` name it in ``PYTHONSTARTUP``); a learner's kernel is left
alone.

Chapter 0: the course's tooling (the website's checks).
"""

from __future__ import annotations

import base64
import struct
import zlib
from dataclasses import dataclass

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text

KEY = "dpcourse:smallest-text-pt"
POINTS_PER_INCH = 72
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
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
        return self.smallest_pt * self.dpi / POINTS_PER_INCH


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
        metadata = {**(metadata or {}), KEY: f"{pt:g}"}
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
    resolution before the pixels)."""
    if isinstance(png, str):
        head, _, data = png.partition("base64,")
        if not head.startswith("data:image/png"):
            raise ValueError(f"not a base64 PNG data URI: {png[:40]!r}")
        data = "".join(data.split())
        data = data[: len(data) // 4 * 4]  # a cut-off URI: whole 4-character groups only
        png = base64.b64decode(data)
    if not png.startswith(_PNG_SIGNATURE):
        raise ValueError("not a PNG: it lacks the PNG signature")
    pt = dpi = None
    width = 0
    at = len(_PNG_SIGNATURE)
    while at + 8 <= len(png):
        (length,), kind = struct.unpack(">I", png[at : at + 4]), png[at + 4 : at + 8]
        body = png[at + 8 : at + 8 + length]
        if kind == b"IHDR" and len(body) >= 8:
            width = struct.unpack(">I", body[:4])[0]
        elif kind == b"pHYs" and len(body) == 9:
            per_unit, _, unit = struct.unpack(">IIB", body)
            if unit == 1:  # pixels per metre
                dpi = round(per_unit * 0.0254, 1)
        elif kind in (b"tEXt", b"zTXt", b"iTXt") and len(body) == length:
            key, _, value = body.partition(b"\0")
            if key.decode("latin-1") == KEY:
                pt = float(_text_value(kind, value))
        elif kind in (b"IDAT", b"IEND"):
            break
        at += 12 + length
    return FigureText(smallest_pt=pt, dpi=dpi, width=width)


def _text_value(kind: bytes, value: bytes) -> str:
    """A text chunk's value, after its key and the key's NUL: tEXt plain, zTXt compressed, iTXt
    with its flags, language and translated key first."""
    if kind == b"tEXt":
        return value.decode("latin-1")
    if kind == b"zTXt":
        return zlib.decompress(value[1:]).decode("latin-1")
    compressed, rest = value[0], value[2:]
    _, _, rest = rest.partition(b"\0")  # language
    _, _, text = rest.partition(b"\0")  # translated key
    return (zlib.decompress(text) if compressed else text).decode("utf-8")
