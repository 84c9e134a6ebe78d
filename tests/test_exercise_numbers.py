"""One numbering scheme for the exercises (issue 34, item 3): "Exercise 5.2" in the headings
(_ext/exercise_pages.py numbers them from the same table), in every check's message and stub,
and in the text, which refers to an exercise by {numref} or by its number; the appendices' labels
(ex-lab-, ex-bugs-) take no chapter's number. From the sources, in well under a second."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dpcourse.harness.exercises import exercise_numbers, numbering, registry, run_check
from dpcourse.harness.exercises.core import CheckResult, exercise
from dpcourse.harness.exercises.student import strip_solution_code

ROOT = Path(__file__).resolve().parents[1]


def test_the_table_is_the_pages_numbering():
    found = numbering.numbers_in_book(ROOT)
    assert found == exercise_numbers.NUMBERS, (
        "the exercises on the pages moved: run `python -m dpcourse.harness.exercises numbers "
        "--write` and commit exercise_numbers.py"
    )
    assert found["ex-5-tree-broadcast"] == "5.1" and found["ex-5-rounds"] == "5.2"
    assert [n for lb, n in found.items() if lb.startswith("ex-lab-")] == [
        "Lab.1", "Lab.2", "Lab.3", "Lab.4"]
    assert all(n.startswith("Bugs.") for lb, n in found.items() if lb.startswith("ex-bugs-"))


def test_a_page_numbers_its_own_exercises_in_order(tmp_path):
    (tmp_path / "chapters").mkdir()
    (tmp_path / "_toc.yml").write_text(
        "root: chapters/intro\nparts:\n- chapters:\n  - file: chapters/05_x\n"
        "  - file: chapters/diagnosis_lab\n")
    (tmp_path / "chapters" / "intro.md").write_text("# Intro\n")
    page = "# 5\n\n```{exercise} A\n:label: ex-5-a\n```\n\n:::{exercise}\n:class: x\n" \
           ":label: ex-5-b\n:::\n\n````{solution} ex-5-a\n:label: ex-5-nope\n````\n"
    (tmp_path / "chapters" / "05_x.md").write_text(page)
    (tmp_path / "chapters" / "diagnosis_lab.md").write_text("```{exercise}\n:label: ex-lab-z\n```")
    assert numbering.numbers_in_book(tmp_path) == {"ex-5-a": "5.1", "ex-5-b": "5.2",
                                                   "ex-lab-z": "Lab.1"}
    # The lab's old labels took chapter 11's number: a page's labels must be its own part's.
    (tmp_path / "chapters" / "diagnosis_lab.md").write_text("```{exercise}\n:label: ex-11-z\n```")
    with pytest.raises(ValueError, match="labelled ex-lab-<slug>"):
        numbering.numbers_in_book(tmp_path)
    with pytest.raises(ValueError, match="ex-<chapter>-<slug>"):
        numbering.parse_label("ex-appendix-z")
    with pytest.raises(ValueError, match="look like"):
        exercise("ex-Lab-z")


def test_every_check_is_an_exercise_of_the_book_and_says_its_number():
    for label, ex in registry().items():
        assert ex.number == exercise_numbers.NUMBERS.get(label), f"{label}: not on any page"
        assert ex.part == label.split("-")[1]
        shown = CheckResult(label, ex.name, "failed", "why").text()
        assert shown == f"✗ Exercise {ex.number} ({label}): failed. why"
    assert list(registry()) == [lb for lb in exercise_numbers.NUMBERS if lb in registry()]
    result = run_check("ex-5-rounds", lambda world_size: world_size - 1)
    assert result.text().startswith("✗ Exercise 5.2 (ex-5-rounds): failed.")
    assert "Exercise 5.2 (ex-5-rounds)" in result.html()
    stub = strip_solution_code("def f():\n    # BEGIN SOLUTION\n    pass\n    # END SOLUTION\n",
                               "ex-5-rounds")
    assert 'NotImplementedError("Exercise 5.2: write your solution here")' in stub


def _prose() -> dict[str, str]:
    """Each page's markdown, without the lines that define labels or open directives."""
    texts = {}
    for path in numbering.book_pages(ROOT):
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        else:
            text = path.read_text()
        texts[path.name] = "\n".join(
            line for line in text.splitlines()
            if not re.match(r"\s*(:label:|[`:]{3,}\{[\w-]+\})", line))  # labels, directives
    return texts


NUMBERED = re.compile(r"\b[Ee]xercises? +([0-9A-Z][\w.]*(?:[-–][0-9][\w.]*)?)")
LABEL = re.compile(r"\bex-(?:\d+|lab|bugs)-[a-z0-9]+(?:-[a-z0-9]+)*")


def test_the_text_names_exercises_by_their_numbers():
    numbers = set(exercise_numbers.NUMBERS.values())
    bad = []
    for page, text in _prose().items():
        for m in NUMBERED.finditer(text):
            if m.group(1).rstrip(".") not in numbers:
                bad.append(f"{page}: {m.group(0)!r} is no exercise's number")
        for m in LABEL.finditer(text):
            label = m.group(0)
            if label not in exercise_numbers.NUMBERS:
                bad.append(f"{page}: {label} is no exercise's label")
                continue
            around = text[max(0, m.start() - 60): m.end() + 60]
            if not (re.search(rf"\{{(?:num)?ref\}}`[^`]*{re.escape(label)}>?`", around)
                    or f"Exercise {exercise_numbers.NUMBERS[label]}" in around):
                bad.append(f"{page}: {label} without its number ({{numref}}`{label}` shows it)")
        # {ref} and {numref} to an exercise show "Exercise 11.2": not after the word again.
        bad += [f"{page}: {m.group(0)!r} says 'Exercise' twice on the page"
                for m in re.finditer(r"\b[Ee]xercises?\s+\{(?:num)?ref\}`[^`]+`", text)]
    assert not bad, "\n".join(bad)


def test_the_map_names_the_appendices_as_their_numbers_do():
    intro = json.loads((ROOT / "chapters" / "intro.ipynb").read_text())
    text = "\n".join("".join(c["source"]) for c in intro["cells"])
    for title, page in numbering.APPENDICES.values():
        row = next(line for line in text.splitlines() if f"<{page}>`" in line)
        assert row.startswith(f"| {title} |"), f"the map's row for {page}: {row[:60]}"


def test_the_numbers_catch_a_stray_number():
    """The prose test fails on the kinds of reference issue 34 found."""
    doubled = re.compile(r"\b[Ee]xercises?\s+\{(?:num)?ref\}`[^`]+`")
    assert doubled.search("Exercise\n{ref}`ex-5-rounds` asks") and not doubled.search(
        "as {numref}`ex-5-rounds` asks")
    for stray in ("See Exercise 16.", "exercises 45-48", "as in ex-5-overlap above"):
        hits = [m.group(0) for m in NUMBERED.finditer(stray) if m.group(1).rstrip(".")
                not in exercise_numbers.NUMBERS.values()]
        hits += [m.group(0) for m in LABEL.finditer(stray)]
        assert hits, stray
