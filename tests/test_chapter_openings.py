"""How each chapter opens (issue 34): what the reader gets out of it, what they need and how long
it takes come first; the map of the package's modules comes after.

The first cell of every chapter and appendix notebook: the title, a paragraph or two on the
question the chapter answers (no module names), the learning objectives, a "Before you start"
box with the prerequisites, an estimate of the reading and running time and a link to the cheat
sheet, and only then the code map (**Code.**). Read from the sources: fast, no build needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
