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

Chapter 0: the course's tooling (the book's text and its runs).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from typing import Any

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
