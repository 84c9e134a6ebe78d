"""Numbers the book's text quotes, taken from the run that printed them (myst-nb's glue).

A sentence such as "overlap saved 13.4 ms" must say what the cells above it measured in the
same run, not what an earlier run measured. A cell hands the number to the text with
:func:`glue` (``prose.glue("overlap_saved", f"{saved * 1e3:.1f} ms")``) and the markdown cell
quotes it with myst-nb's role: ``{glue:text}`overlap_saved` ``. The website, built from the
executed notebook, then shows the run's own number in the sentence.

:func:`glue` writes what ``myst_nb.glue(name, value, display=False)`` writes (a display output
whose data is under ``application/papermill.record/`` and whose metadata names the key), without
needing myst-nb in the kernel: on Colab or Kaggle the notebooks run with the package alone. The
output shows nothing in JupyterLab or on the website. :func:`glued` reads the keys back from an
executed notebook; ``tests/test_prose_numbers.py`` uses it to check that every key the text
quotes was glued.

A sentence that compares or judges what the run measured ("overlap saved more than it cost",
"only the last bucket is left after backward") must hold on every build, not only on the run it
was written after. Either its words come from the run (glue a phrase chosen by the numbers,
``glue("overlap_verdict", "saved" if gain > 0 else "cost")``), or a cell the website hides checks
it with :func:`holds`, whose first argument is the sentence's own words: the build then fails, with
the sentence and what was measured, on the run that contradicts it. The test checks that each
claim is words of the page's text, so that a reworded sentence cannot leave its check behind.

Chapter 0: the course's tooling (the book's text and its runs).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["GLUE_PREFIX", "ProseMismatch", "compared", "glue", "glued", "holds"]

# What myst_nb.glue(..., display=False) puts before each MIME type (myst_nb.ext.glue).
GLUE_PREFIX = "application/papermill.record/"
# myst-nb's roles split "key:format" at the last colon and "doc::key" at "::".
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


def glue(name: str, value: Any, fmt: str = "") -> str:
    """Hand ``value`` to the text under the key ``name``, as ``format(value, fmt)``; return
    that text.

    The markdown quotes it with ``{glue:text}`name` ``. Outside a Jupyter kernel (a script, a
    test) nothing is displayed and only the text is returned. Format in the cell, with the same
    format the cell prints with, so that the text and the output agree to the last digit.
    """
    if not isinstance(name, str) or not _KEY.fullmatch(name):
        raise ValueError(
            f"glue key {name!r}: pass a name of letters, digits, '_', '.' or '-' that starts "
            "with a letter (myst-nb's roles split a key at ':')"
        )
    text = format(value, fmt) if fmt else str(value)
    # import here: optional, absent outside Jupyter
    from IPython import get_ipython  # noqa: PLC0415

    if get_ipython() is None:
        return text
    # import here: optional, absent outside Jupyter
    from IPython.display import display  # noqa: PLC0415

    # text/plain holds the repr of the string, as IPython would show it; myst-nb's glue:text
    # role reads it back with ast.literal_eval.
    display(
        {GLUE_PREFIX + "text/plain": repr(text)},
        raw=True,
        metadata={"scrapbook": {"name": name, "mime_prefix": GLUE_PREFIX}},
    )
    return text


def glued(notebook: Mapping) -> dict[str, str]:
    """``{key: text}`` for every key glued in an executed notebook (an nbformat dict), with or
    without ``display`` (myst_nb.glue's own outputs are read too)."""
    found: dict[str, str] = {}
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        for output in cell.get("outputs", []):
            record = (output.get("metadata") or {}).get("scrapbook")
            if not record or "name" not in record:
                continue
            prefix = record.get("mime_prefix", "")
            plain = (output.get("data") or {}).get(prefix + "text/plain")
            if plain is None:
                continue
            plain = "".join(plain) if isinstance(plain, list) else plain
            try:
                value = ast.literal_eval(plain)
            except (SyntaxError, ValueError):
                value = plain
            found[record["name"]] = str(value)
    return found


def compared(a: float, b: float, *, more: str, less: str, same: str, margin: float = 0.1) -> str:
    """The words for how measurement ``a`` compares with ``b``: ``more`` where ``a`` exceeds
    ``b`` by more than ``margin`` (a share of ``b``), ``less`` where it falls short of it by as
    much, ``same`` otherwise; glue them into the sentence that compares the two."""
    if a > b * (1 + margin):
        return more
    if a < b * (1 - margin):
        return less
    return same


class ProseMismatch(AssertionError):
    """A sentence of the book's text that this run contradicts."""


def holds(claim: str, condition: bool, measured: str) -> None:
    """Check that ``claim``, words of a sentence beside this cell, is true of this run.

    ``condition`` is the claim computed from the run's numbers; ``measured`` says what those
    numbers were, for the message. Raises :class:`ProseMismatch` naming both where the claim
    does not hold: the sentence must then be reworded (or its words chosen by the numbers with
    :func:`glue`), or the run looked into. ``tests/test_prose_numbers.py`` checks that ``claim``
    is words of the page's text.
    """
    if not isinstance(claim, str) or not claim.strip():
        raise ValueError("holds() takes the sentence's own words as its claim")
    if not condition:
        raise ProseMismatch(
            f"the text says {claim!r}, but this run measured {measured}: reword the sentence, "
            "or choose its words by the numbers (prose.glue), or find out why the run changed"
        )
