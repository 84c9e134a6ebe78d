"""The editions rendered from executed notebooks (dpcourse.harness.exercises.student): the student
website shows what running its notebooks would show, without running them again."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import nbformat
import pytest

from dpcourse.harness.exercises.core import display_output, not_attempted, registry, run_check
from dpcourse.harness.exercises.student import (
    copy_book,
    make_executed_edition,
    make_student_edition,
    student_notebook,
    unlink_instructor_pages,
)

ROOT = Path(__file__).resolve().parents[1]


def _executed_chapter() -> dict:
    """A small chapter as `make notebooks` leaves it: outputs on every code cell."""
    out = nbformat.v4.new_output
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("```{exercise}\n:label: ex-1-batch\nDo it.\n```"),
        nbformat.v4.new_code_cell(
            "def growth_when_batch_doubles():\n    # BEGIN SOLUTION\n    print('secret')\n"
            "    return {}\n    # END SOLUTION\n",
            outputs=[out("stream", name="stdout", text="what the solution printed\n")],
            metadata={"tags": ["solution", "hide-input"]},
        ),
        nbformat.v4.new_code_cell(
            "check.batch_growth(growth_when_batch_doubles)",
            outputs=[out("display_data", data={"text/html": "<b>✓ passed</b>"})],
        ),
        nbformat.v4.new_code_cell(
            "print(2 + 2)", outputs=[out("stream", name="stdout", text="4\n")]
        ),
    ]
    return json.loads(nbformat.writes(nb))


def test_the_student_notebook_keeps_outputs_but_the_solutions_and_their_checks():
    student = student_notebook(_executed_chapter(), keep_outputs=True)
    solution, check, other = student["cells"][1:]
    assert "secret" not in "".join(solution["source"]) and solution["outputs"] == []
    want = not_attempted("ex-1-batch", "Exercise 1.1: write your solution here")
    assert check["outputs"] == [display_output(want)]
    assert "not attempted" in check["outputs"][0]["data"]["text/html"]
    assert "".join(other["outputs"][0]["text"]) == "4\n"
    hand_out = student_notebook(_executed_chapter())
    assert all(c.get("outputs", []) == [] for c in hand_out["cells"])


def test_a_stubs_check_says_what_the_student_edition_shows_without_running_it():
    """Every check, run on the student edition's stub, says exactly what the student website
    shows in its place (which is written without running the check). Checks that run the
    learner's function on ranks restart their ranks after it raises (seconds each), so one
    of them stands for all: they share run_learner_on_ranks, which turns the raise into this."""
    on_ranks = [
        label
        for label, ex in registry().items()
        if "run_learner_on_ranks" in inspect.getsource(ex.check)
    ]
    assert on_ranks
    for label in [label for label in registry() if label not in on_ranks] + on_ranks[:1]:
        message = f"Exercise {label}: write your solution here"

        def stub(*args, message=message, **kwargs):
            raise NotImplementedError(message)

        assert run_check(label, stub) == not_attempted(label, message), label


def test_editions_need_an_executed_copy_of_every_current_notebook(tmp_path):
    executed = tmp_path / "executed"
    with pytest.raises(FileNotFoundError, match="make notebooks"):
        make_executed_edition(ROOT, tmp_path / "full", executed)
    for path in (ROOT / "chapters").glob("*.ipynb"):
        target = executed / "chapters" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    notebooks = make_executed_edition(ROOT, tmp_path / "full", executed)
    assert {p.name for p in notebooks} == {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
    config = (tmp_path / "full" / "_config.yml").read_text()
    assert "execute_notebooks: 'off'" in config or "execute_notebooks: off" in config
    assert not (tmp_path / "full" / "chapters" / "conftest.py").exists()
    # An edited notebook makes its executed copy stale.
    stale = json.loads((executed / "chapters" / "intro.ipynb").read_text())
    stale["cells"][1]["source"] = ["print('an older version')\n"]
    (executed / "chapters" / "intro.ipynb").write_text(json.dumps(stale))
    with pytest.raises(FileNotFoundError, match="intro.ipynb"):
        make_student_edition(ROOT, tmp_path / "student", executed)
    with pytest.raises(ValueError, match="folder of its own"):
        copy_book(ROOT, ROOT)


def test_the_student_edition_leaves_out_the_instructor_guide(tmp_path):
    """How grading works is for instructors: the student edition has no instructor guide, its
    table of contents does not list it, and the introduction's link to it keeps only its text."""
    make_student_edition(ROOT, tmp_path / "student")
    chapters = tmp_path / "student" / "chapters"
    assert (ROOT / "chapters" / "instructor_guide.md").exists()
    assert not list(chapters.glob("instructor_guide.*"))
    toc = (tmp_path / "student" / "_toc.yml").read_text()
    assert "instructor_guide" not in toc and "chapters/glossary" in toc
    intro = (chapters / "intro.ipynb").read_text()
    assert "<instructor_guide>" not in intro and "| A–F | Instructor guide, {doc}`glossary" in intro
    assert unlink_instructor_pages("see {doc}`the guide <../chapters/instructor_guide>` and "
                                   "{doc}`instructor_guide`, {doc}`glossary`") == (
        "see the guide and instructor guide, {doc}`glossary`")
