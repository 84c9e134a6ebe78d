"""No path of the machine that built the website on its pages.

A cell's output can name files by their absolute paths: a warning (``/home/ci/.venv/lib/
python3.11/site-packages/torch/nn/modules/transformer.py:143: UserWarning``), the stacks the
launcher prints for a rank that hung, a recorded log (``of binary: /work/main/.venv/bin/python``).
In the reader's own notebook those are the reader's paths, and useful; on the website they are
the build machine's, which tell a reader nothing and leak its layout. The website writes them as
a learner's machine would show them, from the folder a reader recognises:

* ``<anything>/site-packages/torch/...`` as ``site-packages/torch/...``;
* ``<anything>/src/dpcourse/...`` as ``src/dpcourse/...`` (the package, in the repository);
* ``<anything>/.venv/bin/python`` as ``.venv/bin/python``;
* an IPython cell's file, ``/tmp/ipykernel_123/456.py``, as ``<cell>``.

Only cells' outputs change (myst-nb's output blocks), never the text or the code cells.
``tests/test_site.py`` checks that no page of either website shows a path under the folder the
book was built in, or a ``site-packages`` path with the folders before it. Issue 45.

Chapter 0: the course's tooling (the website).
"""

from __future__ import annotations

import re

from docutils import nodes

# A path's leading folders: from a "/" that starts the path (after a space, a quote, "(", "=" or
# the line's start) up to the folder a reader knows.
_LEAD = r"(?:(?<=[\s'\"(=])|^)/(?:[^\s'\"():/]+/)*?"
PATHS = [
    (re.compile(_LEAD + r"(?=site-packages/)", re.M), ""),
    (re.compile(_LEAD + r"(?=src/dpcourse/)", re.M), ""),
    (re.compile(_LEAD + r"(?=\.venv/bin/)", re.M), ""),
    (re.compile(r"/tmp/ipykernel_\d+/\d+\.py"), "<cell>"),
]


def without_machine_paths(text: str) -> str:
    """``text`` with the build machine's leading folders taken off the paths it names."""
    for pattern, replacement in PATHS:
        text = pattern.sub(replacement, text)
    return text


def is_output(node: nodes.Element) -> bool:
    """Whether ``node`` lies in a cell's output (myst-nb's ``cell_output`` container)."""
    while node is not None:
        if "cell_output" in node.get("classes", []):
            return True
        node = node.parent
    return False


def shorten_paths(app, doctree, docname) -> None:
    for block in list(doctree.findall(nodes.literal_block)):
        if not is_output(block):
            continue
        text = block.astext()
        shorter = without_machine_paths(text)
        if shorter != text:
            block.children = [nodes.Text(shorter)]
            block["rawsource"] = shorter


def setup(app):
    app.connect("doctree-resolved", shorten_paths)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
