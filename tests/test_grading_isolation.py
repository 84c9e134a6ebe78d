"""The grader at work (dpcourse.harness.exercises.grading, judge, player): honest submissions on
chapters 1, 3 and 7 get the scores they earn, whatever the chapter's own cells do; adversarial
ones (tests/grading_submissions.py) get nothing they did not earn; loops and killed processes
are stopped and named in the student's terms; the exercises judged apart pass the book's own
answers so."""

from __future__ import annotations

import json
from pathlib import Path

import grading_submissions as subs
import nbformat
import pytest

from dpcourse.harness.exercises import grading
from dpcourse.harness.exercises.judge import JUDGED_APART, judged_apart

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _submission(student: str, nb: nbformat.NotebookNode) -> grading.Submission:
    return grading.Submission(student, f"{student}.ipynb", nbformat.writes(nb).encode())


def _only(nb: nbformat.NotebookNode, functions: set[str]) -> nbformat.NotebookNode:
    """``nb`` without the exercises whose function is not in ``functions`` (a rank check costs
    seconds: the tests run chapter 7's exercise 7.1 only where it shows something)."""
    nb = nbformat.from_dict(json.loads(nbformat.writes(nb)))
    keep = []
    for cell in nb.cells:
        text = "".join(cell.source)
        if any(f"def {f}" in text or f"{f} =" in text or f"({f})" in text
               for f in {"my_all_reduce_gradients", "my_epoch_indices",
                         "my_bucket_assignment"} - functions):
            continue
        keep.append(cell)
    nb.cells = keep
    return nb


def _table(rows: list[grading.GradeRow]) -> dict[tuple[str, str], grading.GradeRow]:
    return {(r.student, r.exercise): r for r in rows}


@pytest.fixture(scope="module")
def graded() -> dict[tuple[str, str], grading.GradeRow]:
    """One run of the grader (two judges, as on a 2-core machine) over honest and adversarial
    submissions and the chapters' own notebooks, for an assignment of the fixtures' exercises
    and every exercise judged apart: a notebook is graded on those of its chapter, and those
    it does not define are "missing" at once."""
    without_74 = {"my_bucket_assignment", "my_epoch_indices"}
    chosen = []
    for part, labels in (("1", subs.CH1), ("3", subs.CH3), ("7", subs.CH7)):
        for name, nb in subs.honest(part, labels).items():
            if part == "7" and name in ("partly", "crashing"):
                nb = _only(nb, without_74)
            chosen.append(_submission(f"{part}-{name}", nb))
    # Right numbers, its argument emptied afterwards: judged apart, the check still sees it.
    mutating = subs.book_answer("7", "my_bucket_assignment").replace(
        "def my_bucket_assignment(param_bytes, cap_bytes):",
        "def my_bucket_assignment(param_bytes, cap_bytes):\n"
        "    answer = _right(list(param_bytes), cap_bytes)\n"
        "    param_bytes.clear()\n"
        "    return answer\n\n\n"
        "def _right(param_bytes, cap_bytes):")
    chosen.append(_submission("7-mutating", subs.notebook("7", {"ex-7-buckets": mutating})))
    for name, (_, nb) in {**subs.adversarial(), **subs.adversarial_other()}.items():
        if name not in ("course-functions", "killing-answer", "needs-a-looping-cell"):
            nb = _only(nb, without_74)
        chosen.append(_submission(name, nb))
    pages = {p: p.read_text() for p in (ROOT / "chapters").glob("*.ipynb")}
    chosen += [grading.Submission(f"book-{p.stem}", str(p), text.encode())
               for p, text in pages.items()
               if any(f":label: {label}" in text for label in JUDGED_APART)]
    assignment = grading.Assignment.of(exercises=sorted({*JUDGED_APART, *subs.CH1, *subs.CH3,
                                                          *subs.CH7}))
    # A cell may take 5 s (the one that never ends is stopped then); ex-3-chunk's check
    # stops the answer that never returns after its 10 s.
    rows = grading.grade(chosen, assignment, jobs=2, timeout=300, cell_timeout=5)
    return _table(rows)


def _status(table, student: str) -> dict[str, str]:
    return {ex: r.status for (s, ex), r in table.items() if s == student and r.status != "missing"}


def test_honest_submissions_get_the_scores_they_earn(graded):
    passed, failed = "passed", "failed"
    assert _status(graded, "1-right") == {"ex-1-batch": passed, "ex-1-max-batch": passed}
    assert _status(graded, "1-partly") == {"ex-1-batch": passed, "ex-1-max-batch": failed}
    assert _status(graded, "1-wrong") == {"ex-1-batch": failed, "ex-1-max-batch": failed}
    assert _status(graded, "1-crashing") == {"ex-1-batch": failed, "ex-1-max-batch": failed}
    assert _status(graded, "3-right") == {"ex-3-chunk": passed, "ex-3-replicas": passed}
    assert _status(graded, "3-partly") == {"ex-3-chunk": passed, "ex-3-replicas": failed}
    assert _status(graded, "3-wrong") == {"ex-3-chunk": failed, "ex-3-replicas": failed}
    assert _status(graded, "7-right") == dict.fromkeys(subs.CH7, passed)
    assert _status(graded, "7-wrong") == dict.fromkeys(subs.CH7, failed)
    assert _status(graded, "7-partly") == {"ex-7-buckets": passed, "ex-7-sampler": failed}
    assert _status(graded, "7-crashing") == {"ex-7-buckets": failed, "ex-7-sampler": failed}
    assert _status(graded, "7-mutating") == {"ex-7-buckets": failed}
    assert "changed its argument" in graded[("7-mutating", "ex-7-buckets")].message
    # The checks' own messages, the learner's line quoted where the function raised.
    assert "start from parameter 0" in graded[("7-wrong", "ex-7-buckets")].message
    assert "divide by 2" in graded[("7-wrong", "ex-7-average")].message
    crash = graded[("7-crashing", "ex-7-sampler")].message
    assert crash.startswith("your function raised IndexError: list index out of range (line 3: "
                            "raise IndexError('list index out of range')) when called with (10,")
    assert "your function raised IndexError" in graded[("3-crashing", "ex-3-replicas")].message
    # The chapter's failing assertion and its slow benchmark never ran: no row mentions them,
    # and none of the cells the grader ran is theirs.
    for row in graded.values():
        if row.student.startswith("book-"):
            continue
        assert "AssertionError" not in row.message and "overlap" not in row.message
        assert not any("assert 0.2" in c or "sleep(3)" in c for c in row.cells), row.cells
    assert graded[("7-right", "ex-7-buckets")].cells == [
        "the cell under Exercise 7.3, which begins "
        '"def my_bucket_assignment(param_bytes, cap_bytes):"']


def test_adversarial_submissions_get_nothing_they_did_not_earn(graded):
    for student in ("replace-checks", "write-log", "exit-after-forged-pass",
                    "replace-references", "patching-answer", "course-functions"):
        scored = {ex: r.status for (s, ex), r in graded.items() if s == student and r.points}
        assert scored == {}, (student, scored)
    assert set(_status(graded, "replace-checks").values()) == {"not attempted"}
    course = {ex: r.message for (s, ex), r in graded.items() if s == "course-functions"}
    assert course["ex-7-buckets"].startswith(
        "your answer is dpcourse.ddp.buckets.bucket_assignment, the course's own function")
    assert course["ex-7-sampler"].startswith(
        "your answer calls dpcourse.ddp.sampler.epoch_indices")
    assert course["ex-7-average"].startswith(
        "your answer is dpcourse.ddp.ddp.all_reduce_gradients")
    assert {graded[("course-functions", ex)].status for ex in subs.CH7} == {"course code"}
    # A cell that loops forever, or kills its kernel, is not run: the right answers score.
    assert _status(graded, "looping-cell") == {"ex-7-buckets": "passed", "ex-7-sampler": "passed"}
    assert _status(graded, "killing-cell") == {"ex-7-buckets": "passed", "ex-7-sampler": "passed"}
    # What the grader cannot stop, as the instructor guide says: an answer checked in the
    # process that runs it (1.3 hands it a model) can replace the check's reference when called.
    assert graded[("patching-answer-local", "ex-1-max-batch")].status == "passed"


def test_messages_name_no_path_of_the_graders_machine(graded):
    import dpcourse

    folders = [str(Path(dpcourse.__file__).resolve().parents[1]), "site-packages", "/tmp/"]
    for row in graded.values():
        for text in (row.message, *row.problems, row.output):
            assert not any(f in text for f in folders), (row.student, row.exercise, text)


def test_loops_and_killed_processes_are_stopped_and_named(graded):
    loop = graded[("looping-answer", "ex-3-chunk")]
    assert loop.status == "failed" and loop.message == (
        "your code timed out: it was still running after 10 s. Look for a loop that never ends.")
    killed = graded[("killing-answer", "ex-7-sampler")]
    assert killed.status == "failed" and killed.message == (
        "when called with (10, 2, 0, 0, 0), the process running your function was killed by "
        "SIGKILL (the machine's out-of-memory killer sends it)")
    stuck = graded[("needs-a-looping-cell", "ex-7-buckets")]
    assert stuck.status == "failed" and stuck.message == (
        'the cell under Exercise 7.3, which begins "import time" was still running after the '
        "time limit of 5 s for a cell, and was stopped: my_bucket_assignment could not be "
        "checked")
    # the other exercises of those notebooks are graded as they deserve
    assert _status(graded, "killing-answer") == {"ex-7-buckets": "passed",
                                                 "ex-7-sampler": "failed",
                                                 "ex-7-average": "passed"}
    assert _status(graded, "needs-a-looping-cell") == {"ex-7-buckets": "failed",
                                                       "ex-7-sampler": "passed",
                                                       "ex-7-average": "passed"}


def test_the_book_answers_pass_where_they_are_judged_apart(graded):
    """Every exercise judged apart passes the chapter's own answer with its check in the judge:
    its check gives the function data and wants data back."""
    book = {ex: r for (s, ex), r in graded.items() if s.startswith("book-")}
    apart = {label for label in JUDGED_APART if judged_apart(label)}
    assert apart and apart <= set(book)
    assert {ex for ex, r in book.items() if r.mode == "apart"} == apart
    assert {ex: r.message for ex, r in book.items() if r.status != "passed"} == {}
