"""dpcourse.listing: the package's code as the chapters show it, dedented, wrapping under itself."""

from __future__ import annotations

import html
import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest

from dpcourse import listing
from dpcourse.ddp import buckets, ddp

CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"

IPython = pytest.importorskip("IPython", reason="the listing's HTML is IPython's Code, highlighted")


def _lines_of(highlighted: str) -> list[tuple[int | None, str]]:
    """(hanging indent in ch, text) of each line block of a listing's HTML."""
    pre = re.search(r"<pre[^>]*>(.*)</pre>", highlighted, re.DOTALL).group(1)
    blocks = re.findall(r'<span style="display: block; padding-left: (\d+)ch; text-indent: '
                        r'-\1ch">(.*?)\n</span>', pre, re.DOTALL)
    return [(int(hang), html.unescape(re.sub(r"<[^>]*>", "", body))) for hang, body in blocks]


def test_a_method_is_shown_without_its_class_indentation():
    shown = listing.show_source(ddp.DDP._hook).source
    assert shown.startswith("def _hook(self")
    assert shown == textwrap.dedent(inspect.getsource(ddp.DDP._hook)).strip("\n") + "\n"


def test_several_objects_one_blank_line_apart():
    parts = (buckets.BucketManager.launch, buckets.BucketManager.finish)
    shown = listing.show_source(*parts).source
    first, second = (textwrap.dedent(inspect.getsource(f)) for f in parts)
    assert shown == first + "\n" + second
    assert "\n\n\n" not in shown


def test_start_shows_the_code_from_a_line_on():
    shown = listing.show_source(buckets.BucketManager.launch, start="bucket.work =").source
    assert shown.startswith("bucket.work = dist.all_reduce(")  # dedented from its 8 spaces


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((), {}, "at least one"),
        ((len,), {}, "no source for <built-in function len>"),
        ((ddp.DDP._hook,), {"start": "no such line"}, "contains 'no such line'"),
        ((ddp.DDP._hook, ddp.DDP.no_sync), {"start": "def"}, "one object's source; got 2"),
    ],
)
def test_bad_input_says_what_to_pass(args, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=re.escape(message)):
        listing.show_source(*args, **kwargs)


def test_each_line_wraps_under_its_own_indentation():
    shown = listing.show_source(buckets.bucket_assignment)
    page = shown._repr_html_()
    lines = _lines_of(page)
    # The text is the source's, line for line, blank lines included, with the highlighting kept.
    assert [text for _, text in lines] == shown.source.splitlines()
    assert '<span class="k">def</span>' in page
    for hang, text in lines:
        indent = len(text) - len(text.lstrip(" "))
        assert hang == indent + listing.CONTINUATION_INDENT, text
    assert {hang for hang, _ in lines} >= {6, 10, 14}  # lines at 0, 4 and 8 spaces


def test_the_notebook_shows_the_code_as_plain_text_too():
    formatter = IPython.core.formatters.PlainTextFormatter()
    shown = listing.show_source(ddp.broadcast_parameters)
    assert formatter(shown) == shown.source
    assert str(shown) == shown.source


def test_hanging_indent_needs_a_pre_block():
    with pytest.raises(ValueError, match="one <pre> block"):
        listing.hanging_indent_html("<div>no code</div>")


def test_the_chapters_show_the_packages_code_as_listings():
    """No notebook shows source by hand (``Code(inspect.getsource(...))``, a printed source): that
    wrapped long lines at column 0 on the website, and kept methods' class indentation."""
    by_hand = [
        f"{path.name}: {cell.get('id')}"
        for path in sorted(CHAPTERS.glob("*.ipynb"))
        for cell in json.loads(path.read_text())["cells"]
        if cell["cell_type"] == "code" and "getsource(" in "".join(cell["source"])
    ]
    assert not by_hand, f"show the code with dpcourse.listing.show_source: {by_hand}"
