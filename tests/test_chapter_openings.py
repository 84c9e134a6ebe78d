"""How each chapter opens (issue 34): what the reader gets out of it, what they need and how long
it takes come first; the map of the package's modules comes after.

The first cell of every chapter and appendix notebook: the title, a paragraph or two on the
question the chapter answers (no module names), the learning objectives, a "Before you start"
box with the prerequisites, an estimate of the reading and running time and a link to the cheat
sheet, and only then the code map (**Code.**). Read from the sources: fast, no build needed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from dpcourse.harness import reading_time

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    p for p in sorted((ROOT / "chapters").glob("*.ipynb")) if p.stem != "intro"
]  # the introduction is the map itself
OBJECTIVES = "```{admonition} Learning objectives"
BEFORE = "```{admonition} Before you start"
MODULE = re.compile(r"`dpcourse\.[\w.]+`")


def opening(path: Path) -> str:
    return "".join(json.loads(path.read_text())["cells"][0]["source"])


def problems(text: str) -> list[str]:
    """What is out of place in a chapter's opening cell (empty when it opens as it should)."""
    found = []
    if OBJECTIVES not in text:
        return ["no learning objectives"]
    if BEFORE not in text:
        return ["no 'Before you start' box after the objectives"]
    objectives, before = text.index(OBJECTIVES), text.index(BEFORE)
    if not objectives < before:
        found.append("the 'Before you start' box comes before the objectives")
    early = MODULE.findall(text[:objectives])
    if early:
        found.append(f"module names before the objectives: {early}")
    box = text[before : text.index("```", before + len(BEFORE))]
    for what, pattern in (
        ("the prerequisites", r"\*\*You need\*\*"),
        ("a reading time", r"about \d+ minutes to read"),
        ("a running time", r"the notebook runs in (about|under) "),
        ("a link to the cheat sheet", r"\{doc\}`[^`]*<cheat_sheet>`|\{doc\}`cheat_sheet`"),
    ):
        if not re.search(pattern, box):
            found.append(f"the 'Before you start' box lacks {what}")
    code = text.find("**Code.**")
    if code != -1 and code < before:
        found.append("the code map (**Code.**) comes before the 'Before you start' box")
    return found


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_the_chapter_opens_with_objectives_prerequisites_and_time_then_the_code(path):
    assert not problems(opening(path)), f"{path.name}: {problems(opening(path))}"


def test_the_check_sees_an_opening_in_the_old_order():
    old = (
        "# 6. Ring all-reduce\n\nWhy.\n\n**Code.** This chapter builds `dpcourse.collectives.ring`."
        f"\n\n{OBJECTIVES}\n:class: tip\n\n* run the ring\n```"
    )
    assert problems(old) == ["no 'Before you start' box after the objectives"]
    with_box = old + (
        f"\n\n{BEFORE}\n:class: note\n\n* **You need** chapter 5.\n* **Time:** about 40 minutes "
        "to read; the notebook runs in about 2 minutes.\n```"
    )
    assert problems(with_box) == [
        "module names before the objectives: ['`dpcourse.collectives.ring`']",
        "the 'Before you start' box lacks a link to the cheat sheet",
        "the code map (**Code.**) comes before the 'Before you start' box",
    ]


# --- Issue 45: the reading time is computed from the page -------------------------------------
EXECUTED = Path(os.environ.get("DPCOURSE_EXECUTED") or ROOT / "_build" / "executed") / "chapters"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_the_opening_states_the_reading_time_its_main_path_computes_to(path):
    ran = EXECUTED / path.name
    if not ran.exists():
        if os.environ.get("DPCOURSE_REQUIRE_SITE"):
            raise AssertionError(f"no executed copy of {path.name}: run `make notebooks`")
        pytest.skip(f"no executed copy of {path.name} (its listings are outputs): make notebooks")
    time = reading_time.reading_time(json.loads(path.read_text()), json.loads(ran.read_text()))
    why = reading_time.stale(opening(path), time)
    assert why is None, (
        f"{path.name}: its opening's reading time is stale ({why}); it should say "
        f"{reading_time.time_clause(time)!r}: write it with "
        "`python -m dpcourse.harness.reading_time --write` (after make notebooks)")


def test_a_reading_time_is_stale_only_beyond_what_about_allows():
    time = reading_time.ReadingTime(words=3000, code_lines=400, deep_dive_words=0,
                                    deep_dive_code_lines=50)
    said = reading_time.time_clause(time)
    assert reading_time.stale(said, time) is None
    edited = reading_time.ReadingTime(3100, 410, 0, 50)  # a paragraph and a listing's lines
    assert reading_time.stale(said, edited) is None
    grown = reading_time.ReadingTime(3000, 520, 0, 50)  # a section of code added
    assert "lines of code: it says 400, the page computes to 520" in reading_time.stale(said, grown)
    assert "minutes: it says 60" in reading_time.stale(said, grown)
    assert "states no reading time" in reading_time.stale("about an hour", time)


def test_the_main_path_leaves_out_deep_dives_exercises_and_what_is_folded():
    def md(text):
        return {"cell_type": "markdown", "id": "m", "metadata": {}, "source": text}

    def code(text, tags=(), outputs=()):
        return {"cell_type": "code", "id": text[:8], "metadata": {"tags": list(tags)},
                "outputs": list(outputs), "source": text}

    listing = {"output_type": "execute_result", "data": {"text/plain": "def f():\n    return 1"}}
    notebook = {"cells": [
        md("# Title\n\nfive words are on it.\n\n```bash\nmake lab\n```"),
        md("::::{admonition} Deep dive: six more words here, folded\n:class: dropdown\n\n"
           "seven words inside the deep dive, not main.\n::::"),
        code("x = 1\n\ny = 2"), code("show_source(f)", outputs=[listing]),
        code("z = 3", tags=["hide-cell", "deep-dive"]), code("w = 4", tags=["remove-cell"]),
        md("```{admonition} Where the code lives\n:class: dropdown\n\nnot counted at all\n```"),
        md("## Exercises\n\nten words of an exercise that the main path leaves out."),
        code("check.something(f)"),
        md("## References\n\nnone"),
    ]}
    time = reading_time.reading_time(notebook)
    # "Title", "five words are on it." and the deep dive's one-line summary; 1 + 2 + 1 + 2 lines
    # of code (the bash block, two lines, the call, the listing's two)
    assert (time.code_lines, time.deep_dive_code_lines) == (6, 1)
    assert time.words == 1 + 5 + 7 and time.deep_dive_words == 8
    assert time.minutes == 5 and reading_time.time_clause(time).startswith(
        "about 5 minutes to read the main path (13 words at 150 a minute and 6 lines of code")
