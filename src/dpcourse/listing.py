"""The package's own code shown on the page: functions and methods as one listing, dedented.

Chapters print the code they explain next to the text (``show_source(ddp.DDP._hook, ...)``).
``inspect.getsource`` gives a method with its class's indentation, and the package's lines run to
100 characters, wider than the website's code column (about 80 characters in a laptop's window).
A listing removes the indentation the pieces share and, on the page, wraps a line too long for
its box under its own indentation (a hanging indent), never at the box's left edge: a wrapped
comment or string there read as code at column 0. Its lines and indentation are the source's.

Chapter 0: course-wide; chapters 6, 7, 9, 10 and the bug hunt show the package's code with it.
"""

from __future__ import annotations

import html
import inspect
import re
import textwrap
from dataclasses import dataclass

__all__ = ["Listing", "show_source", "hanging_indent_html"]

# How much further than its own indentation a wrapped line's continuation starts, in characters:
# past the indentation of a block inside it (4), so that it does not read as one.
CONTINUATION_INDENT = 6

_TAG = re.compile(r"<[^>]*>")
_PRE = re.compile(r"(<pre[^>]*>)(.*?)(</pre>)", re.DOTALL)


@dataclass(frozen=True)
class Listing:
    """Source code to show in a notebook: the text as it is (``str``, the notebook's plain-text
    output) and highlighted HTML whose long lines wrap under their own indentation (the page)."""

    source: str
    language: str = "python"

    def __str__(self) -> str:
        return self.source

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # IPython's text/plain: the code
        printer.text(self.source)

    def _repr_html_(self) -> str:
        # import here: IPython (with pygments) is the notebook's, not a dependency of the package
        from IPython.display import Code  # noqa: PLC0415

        return hanging_indent_html(Code(self.source, language=self.language)._repr_html_())


def show_source(*objects, start: str | None = None) -> Listing:
    """The source of ``objects`` (functions, methods, classes or modules of the package), each
    dedented, one blank line between them, as a :class:`Listing` a notebook shows highlighted.

    ``start``: show the (single) object's code from the first line that contains this text on,
    dedented again (the bug hunt shows a function's body without its signature and docstring).
    Used by chapters 6, 7, 9 and 10 and the bug hunt instead of ``Code(inspect.getsource(...))``.
    """
    if not objects:
        raise ValueError("show_source needs at least one function, method, class or module")
    if start is not None and len(objects) != 1:
        raise ValueError(f"start= picks a line in one object's source; got {len(objects)} objects")
    pieces = []
    for obj in objects:
        try:
            code = inspect.getsource(obj)
        except (OSError, TypeError) as err:
            raise TypeError(
                f"show_source: no source for {obj!r} ({err}); pass a function, method, class or "
                "module defined in a file (not a builtin, nor a name bound in the notebook)"
            ) from None
        if start is not None:
            lines = code.splitlines(keepends=True)
            at = next((i for i, line in enumerate(lines) if start in line), None)
            if at is None:
                raise ValueError(
                    f"show_source: no line of {getattr(obj, '__qualname__', obj)!r}'s source "
                    f"contains {start!r}; pass text from the line to start at"
                )
            code = "".join(lines[at:])
        pieces.append(textwrap.dedent(code).strip("\n") + "\n")
    return Listing("\n".join(pieces))


def hanging_indent_html(highlighted: str) -> str:
    """Pygments' HTML (``<pre>``, one source line per line) with each line in a block whose
    wrapped continuation starts :data:`CONTINUATION_INDENT` characters past the line's own
    indentation, so that a line too long for its box wraps under itself, not at column 0.

    The styles are inline, so the notebook and the website show the same; the text of each line,
    its newline included, is unchanged (copying the listing copies the code)."""
    match = _PRE.search(highlighted)
    if match is None:
        raise ValueError("hanging_indent_html expects pygments' HTML, with one <pre> block")
    head, body, tail = match.groups()
    lines = body.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline after the last line
    blocks = []
    for line in lines:
        text = html.unescape(_TAG.sub("", line))
        hang = len(text) - len(text.lstrip(" ")) + CONTINUATION_INDENT
        blocks.append(
            f'<span style="display: block; padding-left: {hang}ch; text-indent: -{hang}ch">'
            f"{line}\n</span>"
        )
    return highlighted[: match.start()] + head + "".join(blocks) + tail + highlighted[match.end() :]
