"""The built website: every page of the table of contents is there, executed, with its figures.

`make test` builds the book first and sets DPCOURSE_REQUIRE_SITE=1, so these tests fail rather
than skip when the site is missing. Run alone (`pytest`), they skip until `make book` has run.
"""

from __future__ import annotations

import os
import re
from html import unescape
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"

if not (HTML / "index.html").exists():
    if os.environ.get("DPCOURSE_REQUIRE_SITE"):
        raise RuntimeError(f"{HTML / 'index.html'} is missing: `make book` did not build the site")
    pytest.skip("the book is not built: run `make book` first", allow_module_level=True)


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]
    for part in toc.get("parts", []):
        files += [c["file"] for c in part.get("chapters", [])]
    return files


def page(name: str) -> str:
    return (HTML / f"{name}.html").read_text()


def text_of(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", "", html))


@pytest.mark.parametrize("name", toc_files())
def test_every_toc_page_is_built_with_its_images(name):
    html = page(name)
    assert "<h1>" in html
    for src in re.findall(r'<img[^>]+src="([^"]+)"', html):
        if src.startswith(("http:", "https:", "data:")):
            continue
        assert (HTML / name).parent.joinpath(src).resolve().exists(), f"{name}: missing image {src}"
    assert "Traceback (most recent call last)" not in text_of(html), f"{name} shows an error"
    assert "CC BY 4.0" in text_of(html) and "MIT License" in text_of(html), f"{name}: footer"
    if (ROOT / f"{name}.ipynb").exists():  # the download button's notebook (issue 33)
        assert f'_sources/{name}.ipynb"' in html and (HTML / "_sources" / f"{name}.ipynb").exists()


def test_index_opens_on_the_intro():
    assert "chapters/intro.html" in (HTML / "index.html").read_text()


def test_intro_shows_this_machine_and_a_four_rank_run():
    text = text_of(page("chapters/intro"))
    assert "CPU cores:" in text and "auto backend for 2 ranks:" in text
    for r in range(4):
        assert f"[rank {r}] I hold {r + 1}" in text
    assert "[10.0, 10.0, 10.0, 10.0]" in text


def test_chapter_1_has_executed_figures():
    html = page("chapters/01_single_device")
    figures = re.findall(r'<img[^>]+src="\.\./_images/[^"]+\.png"', html)
    assert len(figures) >= 3, f"chapter 1 shows {len(figures)} figures"
    assert "cell_output" in html


STUDENT_HTML = ROOT / "_build" / "student" / "_build" / "html"


def test_full_site_folds_solutions_away():
    html = page("chapters/01_single_device")
    assert html.count('class="solution dropdown') >= 3
    assert "tag_hide-input" in html  # solution code cells are collapsed


def test_student_site_has_no_solution_text():
    from dpcourse.harness.exercises.student import solution_lines

    if not (STUDENT_HTML / "index.html").exists():
        if os.environ.get("DPCOURSE_REQUIRE_SITE"):
            raise AssertionError("the student site is missing: `make student` did not build it")
        pytest.skip("the student site is not built: run `make student` first")
    secrets = solution_lines(ROOT)
    assert secrets
    pages = sorted(STUDENT_HTML.joinpath("chapters").glob("*.html"))
    assert {p.stem for p in pages} >= {"intro", "01_single_device"}
    for p in pages:
        text = unescape(p.read_text())
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{p.name} leaks: {leaked[:3]}"
        assert "solution dropdown" not in text
    ch1 = text_of((STUDENT_HTML / "chapters" / "01_single_device.html").read_text())
    assert "not attempted" in ch1  # the checks ran on the unsolved stubs
