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


# --- Issue 45: the code can be had from the site ------------------------------------------------
ARCHIVE = "downloads/data-parallelism-from-scratch.zip"


def test_the_site_serves_the_wheel_and_the_course_archive_and_every_page_offers_them():
    import zipfile

    import dpcourse

    wheel = f"dpcourse-{dpcourse.__version__}-py3-none-any.whl"
    assert (HTML / "downloads" / wheel).is_file()
    assert f'href="{wheel}"' in (HTML / "downloads" / "index.html").read_text()  # pip's page
    with zipfile.ZipFile(HTML / ARCHIVE) as archive:
        names = {Path(n).name for n in archive.namelist()}
    assert {wheel, "README.txt"} <= names
    notebooks = {n for n in names if n.endswith(".ipynb")}
    assert notebooks == {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
    for name in toc_files():
        html = page(name)
        up = "../" * name.count("/")
        assert f'href="{up}{ARCHIVE}"' in html, f"{name}: its download menu has no course .zip"
        assert f'href="{up}downloads/{wheel}"' in html, f"{name}: no dpcourse .whl"


def test_the_student_sites_archive_has_no_solution():
    import json
    import zipfile

    from dpcourse.harness.exercises.student import solution_lines

    if not (STUDENT_HTML / ARCHIVE).exists():
        if os.environ.get("DPCOURSE_REQUIRE_SITE"):
            raise AssertionError(f"the student site serves no {ARCHIVE}")
        pytest.skip("the student site is not built: run `make student` first")
    secrets = solution_lines(ROOT)
    with zipfile.ZipFile(STUDENT_HTML / ARCHIVE) as archive:
        for name in archive.namelist():
            if name.endswith(".ipynb"):
                cells = json.loads(archive.read(name))["cells"]
                text = "\n".join("".join(c["source"]) for c in cells)
                leaked = [s for s in secrets if s in text]
                assert not leaked, f"{name} leaks: {leaked[:3]}"
                assert not any(c.get("outputs") for c in cells), f"{name} has outputs"


def test_no_page_shows_a_path_of_the_machine_that_built_it():
    """Outputs name files as site-packages/torch/... or src/dpcourse/... (_ext/machine_paths.py),
    never under the folder the book was built in or with the folders before site-packages."""
    absolute = re.compile(r"/[^\s'\"():]+/(?:site-packages|\.venv)/")
    for site in (HTML, STUDENT_HTML):
        for path in sorted(site.joinpath("chapters").glob("*.html")):
            text = text_of(path.read_text())
            assert str(ROOT) not in text, f"{path.name} names the build's folder {ROOT}"
            found = absolute.findall(text)
            assert not found, f"{path.name} shows the build machine's paths: {found[:3]}"


# --- Issue 34: exercises as a learner meets them, and what works on the static site ---------
EXERCISE_HEADING = re.compile(
    r'<div class="exercise admonition" id="([^"]+)">\s*<p class="admonition-title">'
    r'<span class="caption-number">Exercise ([^ <]+) </span>')


def test_every_exercise_heading_shows_the_number_its_checks_say():
    from dpcourse.harness.exercises.exercise_numbers import NUMBERS

    shown = {}
    for name in toc_files():
        shown.update(EXERCISE_HEADING.findall(page(name)))
    assert shown == NUMBERS  # every exercise of the book, by the table the checks use
    ch5 = text_of(page("chapters/05_collectives"))
    assert "Solution to Exercise 5.1" in ch5 and "Exercise 16" not in ch5


def test_a_coding_exercise_shows_its_starter_and_check_before_the_folded_solution():
    html = page("chapters/05_collectives")
    start = html.index('id="ex-5-rounds"')
    end = html.index('class="exercise admonition"', start + 1)
    block = html[start:end]
    solution = block.index('class="solution dropdown')
    assert block.index("exercise-starter") < solution
    visible, folded = text_of(block[:solution]), text_of(block[solution:])
    stub = 'NotImplementedError("Exercise 5.2: write your solution here")'
    assert visible.index(stub) < visible.index("check.rounds(broadcast_rounds)")
    assert "bit_length" not in visible and "passed." not in visible  # no answer before the fold
    assert "bit_length" in folded and "Exercise 5.2 (ex-5-rounds)" in folded
    assert "passed." in folded  # what the reference's check printed, inside the fold
    guide = text_of(page("chapters/instructor_guide"))
    assert "✗ Exercise 5.2 (ex-5-rounds): failed." in guide  # a failed check, run at build time


def test_worked_answers_are_folded_under_the_label_the_text_quotes():
    for name in ("chapters/05_collectives", "chapters/06_ring_all_reduce", "chapters/10_scaling"):
        html = page(name)
        labels = re.findall(r'<p class="collapsed admonition-title">([^<]+)</p>', html)
        assert labels.count("Show the worked answer") >= 2, name
        text = " ".join(text_of(html).replace("“", '"').replace("”", '"').split())
        assert '("Show the worked answer")' in text and '("Click to show")' not in text, name


def test_search_has_one_box_snippets_and_names_its_glossary_hits():
    chapter = page("chapters/05_collectives")
    assert chapter.count("search-button-field") == 1  # the sidebar's, not the header's too
    options = (HTML / "_static" / "documentation_options.js").read_text()
    assert "SHOW_SEARCH_SUMMARY: true" in options
    search = (HTML / "search.html").read_text()
    assert "_static/page_texts.js" in search and "_static/search_results.js" in search
    texts = (HTML / "_static" / "page_texts.js").read_text()
    assert '"chapters/glossary.html"' in texts and 'id=\\"term-all-reduce\\"' in texts
    assert "<img" not in texts and "data:image" not in texts  # prose, not outputs


def test_the_ring_explorer_carries_its_frames():
    html = page("chapters/06_ring_all_reduce")
    assert 'class="ring-explorer"' in html and "var data = {" in html
    assert "widget-view+json" not in html[html.index('class="ring-explorer"') - 3000:
                                          html.index('class="ring-explorer"')]
