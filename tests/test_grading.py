"""Grading's parts that run no learner's code: reading a notebook's code (what an exercise
needs, the cells as Jupyter names them, the course's own functions an answer names), the data
that crosses from a learner's process, assignments, students and the records. The grader at
work on submissions: tests/test_grading_isolation.py."""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from dpcourse.ddp import buckets, sampler
from dpcourse.harness.exercises import core, grading, judge, learner_data, registry
from dpcourse.harness.exercises.judge import JUDGED_APART, judged_apart, without_paths
from dpcourse.harness.exercises.notebook_code import Notebook, course_callables

ROOT = Path(__file__).resolve().parents[1]


def _notebook(*cells: str, counts: list[int | None] | None = None) -> dict:
    """Cells given as text: "md:" starts a markdown cell, anything else is code."""
    nb = nbformat.v4.new_notebook()
    for i, c in enumerate(cells):
        if c.startswith("md:"):
            nb.cells.append(nbformat.v4.new_markdown_cell(c[3:]))
        else:
            cell = nbformat.v4.new_code_cell(c)
            cell.execution_count = counts[i] if counts else None
            nb.cells.append(cell)
    return json.loads(nbformat.writes(nb))


def _chosen(nb: Notebook, name: str) -> list[str]:
    return [f"{s.cell.index}.{s.index}" for s in nb.needed({name})]


# ----------------------------------------------------------------------- what an exercise needs
def test_an_exercise_needs_its_definitions_not_the_lessons_measurements():
    nb = Notebook(_notebook(
        "import torch\nimport os\nfrom dpcourse.ddp import buckets\npool = start_ranks()",
        "SCALE = 2\nassert measured_overlap() > 0.5  # the chapter's timing: not the student's",
        "torch.manual_seed(0)\nbenchmark(torch)",
        "def helper(x):\n    return x * SCALE\nwhile True:\n    pass",
        "table = []\ntable.append(3)\ntable[0] = 4\nprint(table)",
        "md:```{exercise} x\n:label: ex-7-buckets\n```",
        "def my_bucket_assignment(sizes, cap):\n    return [helper(s) for s in sizes] + table",
        "def my_bucket_assignment(sizes, cap):  # redefined: the later one counts\n"
        "    return torch.tensor(helper(1))",
    ))
    # The imports, helper and SCALE (its statements only), the table and what changes it in
    # place, both definitions, in order: not the pool, the assertion, the loop or torch's seed.
    assert _chosen(nb, "my_bucket_assignment") == ["0.0", "1.0", "3.0", "4.0", "4.1", "4.2",
                                                   "6.0", "7.0"]
    assert nb.cells[-1].exercise == "ex-7-buckets" and nb.cells[0].exercise is None


def test_cells_are_named_as_jupyter_shows_them():
    nb = Notebook(_notebook(
        "import torch", "md:```{exercise} x\n:label: ex-7-buckets\n```",
        "def my_bucket_assignment(s, c):\n    return []", "x = 1", counts=[12, None, None, 14]))
    first, under, counted = nb.cells
    assert first.describe() == 'the cell In [12], which begins "import torch"'
    assert under.filename == "<cell under Exercise 7.3>"
    assert under.describe() == ('the cell under Exercise 7.3, which begins '
                                '"def my_bucket_assignment(s, c):"')
    assert counted.filename == "<cell In [14]>"
    twin = Notebook(_notebook("md:```{exercise} x\n:label: ex-7-buckets\n```", "a = 1", "b = 2"))
    assert [c.filename for c in twin.cells] == ["<cell under Exercise 7.3>",
                                                "<cell under Exercise 7.3 #2>"]


def test_ipython_syntax_is_read_and_a_cell_that_is_not_python_is_named():
    nb = Notebook(_notebook("%matplotlib inline\nimport torch", "!pip install x",
                            "def my_f(:\n    pass"))
    assert nb.cells[0].problem is None and "run_line_magic" in nb.cells[0].source
    assert _chosen(nb, "torch") == ["0.1"]
    problems = nb.cell_problems(nb.needed({"my_f"}), {"my_f"})
    assert len(problems) == 1 and "is not Python: SyntaxError" in problems[0]


def test_every_exercise_of_the_book_finds_all_it_reads():
    """For each exercise, the code the grader would run from the chapter's own notebook defines
    the function and every global name that code reads (or the name is a builtin)."""
    import builtins

    pages = {p: p.read_text() for p in (ROOT / "chapters").glob("*.ipynb")}
    read: dict[Path, Notebook] = {}
    for label, ex in registry().items():
        if not ex.function:
            continue
        page = next(p for p, text in pages.items() if f":label: {label}" in text)
        nb = read.setdefault(page, Notebook(json.loads(pages[page])))
        chosen = nb.needed({ex.function})
        bound = {n for s in chosen for n in s.binds}
        assert ex.function in bound, label
        unbound = {n for s in chosen for n in s.reads} - bound - set(dir(builtins))
        assert not unbound, (label, unbound)


# ------------------------------------------------------------------------ the course's own code
def test_the_course_functions_an_answer_names_are_found_through_its_imports():
    nb = Notebook(_notebook(
        "import dpcourse.ddp.sampler as s\nfrom dpcourse.ddp import buckets\n"
        "from dpcourse.ddp.ddp import *\nfrom dpcourse.harness.launch import run_ranks",
        "my_bucket_assignment = buckets.bucket_assignment",
        "def my_epoch_indices(*a):\n    return s.epoch_indices(*a)",
        "def my_all_reduce_gradients(m):\n    run_ranks(print, 1)\n    all_reduce_gradients(m)",
    ))
    assert course_callables(nb.needed({"my_bucket_assignment"})) == {
        "dpcourse.ddp.buckets.bucket_assignment": buckets.bucket_assignment}
    assert course_callables(nb.needed({"my_epoch_indices"})) == {
        "dpcourse.ddp.sampler.epoch_indices": sampler.epoch_indices}
    # through the star import; the launcher is the machinery, not an answer
    found = course_callables(nb.needed({"my_all_reduce_gradients"}))
    assert list(found) == ["dpcourse.ddp.ddp.all_reduce_gradients"]


# --------------------------------------------------------------------------- data, not objects
def test_learner_data_round_trips_data_and_refuses_objects():
    values = [None, True, 3, -2.5, float("inf"), "text", b"\x00\x01", [1, [2]], (1, 2),
              {1, 2}, {"a": 1, 2: (3,)}, torch.float16, torch.Size([2, 3]),
              np.float32(1.5), np.arange(6, dtype=np.int16).reshape(2, 3)]
    for value in values:
        back = learner_data.decode(learner_data.encode(value))
        if isinstance(value, np.ndarray):
            assert back.dtype == value.dtype and (back == value).all()
        else:
            assert back == value and type(back) in (type(value), tuple, float), value
    for t in (torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), torch.empty(0, 4),
              torch.tensor([1.0, float("nan")])[1:]):
        back = learner_data.decode(learner_data.encode(t))
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.nan_to_num(), t.nan_to_num())
    for obj in (torch.nn.Linear(2, 2), iter([1]), object(), lambda: 1, np.array(["a"])):
        with pytest.raises(learner_data.NotData):
            learner_data.encode(obj)
    for text in ('{"pickle": "cos\\nsystem"}', '{"dtype": "Tensor"}', '{"float": "1e999"}x',
                 '{"tensor": "", "dtype": "not_a_dtype", "shape": []}'):
        with pytest.raises(ValueError):
            learner_data.decode(text)


def _helper(fn):
    return core.run_learner_on_ranks(fn, 2)  # an attribute of a module: named too


def _check(fn):
    return [_helper(fn) for _ in range(2)]  # inside a comprehension: its own code object


def test_a_check_that_looks_inside_the_process_is_not_judged_apart():
    """JUDGED_APART names exercises (tests/test_grading_isolation.py grades the book's answers
    so); one whose check names a helper that looks at the learner's function from inside the
    process (its arguments changed in place, shared memory, devices, ranks) is checked in the
    player whatever the list says: what the check's functions of its module name counts too."""
    assert JUDGED_APART <= set(registry())
    assert judged_apart("ex-7-buckets") and not judged_apart("ex-7-average")
    assert not judged_apart("ex-3-chunk")  # its views are compared with its input's memory
    assert "run_learner_on_ranks" in judge.names_used(_check)
    assert not judge.names_used(judge.names_used) & judge.IN_PROCESS


# -------------------------------------------------------------------------- assignments, people
def test_an_assignment_names_a_chapter_or_exercises():
    assert grading.Assignment.of("7").exercises == (
        "ex-7-average", "ex-7-hook", "ex-7-buckets", "ex-7-sampler", "ex-7-bucketed-ddp")
    mixed = grading.Assignment.of(exercises=["7.4", "ex-7-buckets"], points={"ex-7-buckets": 3})
    assert mixed.exercises == ("ex-7-buckets", "ex-7-sampler")
    assert mixed.points_of("ex-7-buckets") == 3 and mixed.points_of("ex-7-sampler") == 1
    assert grading.Assignment.of("lab").parts() == ["lab"]
    with pytest.raises(ValueError, match="chapter 99 has no checked exercises; those that have"):
        grading.Assignment.of("99")
    with pytest.raises(ValueError, match="no checked exercise '7.5'"):
        grading.Assignment.of(exercises=["7.5"])  # a measurement: no check
    with pytest.raises(ValueError, match="not in the assignment"):
        grading.Assignment.of("1", points={"ex-7-buckets": 2})


def test_students_come_from_folders_names_or_a_pattern(tmp_path):
    for name in ("alice/07_ddp.ipynb", "alice/.ipynb_checkpoints/07_ddp-checkpoint.ipynb",
                 "bob_07_ddp.ipynb", "carol_1234_07_ddp.ipynb"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    found = grading.find_submissions([tmp_path])
    assert [(s.student, Path(s.name).name) for s in found] == [
        ("alice", "07_ddp.ipynb"), ("bob_07_ddp", "bob_07_ddp.ipynb"),
        ("carol_1234_07_ddp", "carol_1234_07_ddp.ipynb")]
    by_pattern = grading.find_submissions([tmp_path], student_pattern=r"^([a-z]+)[_/]")
    assert [s.student for s in by_pattern] == ["alice", "bob", "carol"]
    assert {s.student for s in grading.find_submissions([tmp_path], student="dana")} == {"dana"}
    with pytest.raises(ValueError, match="finds no student"):
        grading.find_submissions([tmp_path], student_pattern=r"^(\d+)_")
    with pytest.raises(FileNotFoundError, match="no such submission"):
        grading.find_submissions([tmp_path / "missing"])


def test_a_notebook_of_another_chapter_is_refused_without_running_anything(tmp_path):
    nb = _notebook("md:```{exercise} x\n:label: ex-1-batch\n```", "def growth_when_batch_doubles"
                   "():\n    import os\n    os.system('touch ran')")
    subs = [grading.Submission("alice", "alice/01.ipynb", json.dumps(nb).encode()),
            grading.Submission("bob", "bob/x.ipynb", b"{ not json")]
    rows = grading.grade(subs, grading.Assignment.of("7"))
    assert [(r.student, r.exercise, r.status, r.points, r.max_points) for r in rows] == [
        ("alice", "-", "not run", 0, 0), ("bob", "-", "not run", 0, 0)]
    assert rows[0].message == ("this notebook is chapter 1, but the assignment is chapter 7: "
                               "hand in that chapter's notebook")
    assert rows[1].message.startswith("not a notebook")


# ----------------------------------------------------------------------------------- records
def _rows() -> list[grading.GradeRow]:
    row = grading.GradeRow
    return [
        row("alice", "s/alice/07.ipynb", "7", "ex-7-buckets", "passed", 3, 3, "ok",
            cells=['the cell under Exercise 7.3, which begins "def my_bucket_assignment("'],
            output="<script>alert(1)</script>"),
        row("alice", "s/alice/07.ipynb", "7", "ex-7-sampler", "failed", 0, 1, "expected <[1]>",
            problems=["the cell In [3] raised NameError: name 'x' is not defined, line 2"]),
        row("alice", "s/alice/07b.ipynb", "7", "ex-7-sampler", "passed", 1, 1, "ok"),
        row("bob", "s/bob.ipynb", "1", "-", "not run", 0, 0, "this notebook is chapter 1, ..."),
    ]


def test_records_scores_totals_and_feedback(tmp_path):
    assignment = grading.Assignment.of(exercises=["7.3", "7.4"], points={"ex-7-buckets": 3})
    written = grading.write_records(_rows(), tmp_path / "grades", assignment)
    assert [p.name for p in written] == ["scores.csv", "totals.csv", "alice.html", "bob.html"]
    scores = list(csv.DictReader(open(tmp_path / "grades" / "scores.csv")))
    assert list(scores[0]) == grading.SCORE_COLUMNS
    assert scores[0]["number"] == "7.3" and scores[0]["points"] == "3"
    totals = list(csv.DictReader(open(tmp_path / "grades" / "totals.csv")))
    # the best of alice's two notebooks per exercise; bob handed in no chapter-7 notebook
    assert totals == [
        {"student": "alice", "total": "4", "max": "4", "ex-7-buckets": "3", "ex-7-sampler": "1"},
        {"student": "bob", "total": "0", "max": "4", "ex-7-buckets": "0", "ex-7-sampler": "0"}]
    page = (tmp_path / "grades" / "feedback" / "alice.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page and "expected &lt;[1]&gt;" in page
    assert "NameError" in page and "07b.ipynb: 1/1 points" in page


def test_regrading_one_student_keeps_the_others(tmp_path):
    out = tmp_path / "grades"
    grading.write_records(_rows(), out)
    again = [grading.GradeRow("bob", "s/bob.ipynb", "7", "ex-7-buckets", "passed", 1, 1, "ok")]
    grading.write_records(again, out, only="bob")
    rows = grading.read_scores(out / "scores.csv")
    assert [(r.student, r.exercise, r.status) for r in rows] == [
        ("alice", "ex-7-buckets", "passed"), ("alice", "ex-7-sampler", "failed"),
        ("alice", "ex-7-sampler", "passed"), ("bob", "ex-7-buckets", "passed")]
    assert "passed" in (out / "feedback" / "bob.html").read_text()


def test_gradescope_results_list_every_exercise_of_the_assignment():
    assignment = grading.Assignment.of(exercises=["7.3", "7.4", "7.1"],
                                       points={"ex-7-buckets": 3})
    alice = [r for r in _rows() if r.student == "alice"]
    result = grading.gradescope_results(alice, assignment)
    assert [(t["name"], t["score"], t["max_score"], t["status"]) for t in result["tests"]] == [
        ("Exercise 7.1 (ex-7-average)", 0, 1, "failed"),
        ("Exercise 7.3 (ex-7-buckets)", 3, 3, "passed"),
        ("Exercise 7.4 (ex-7-sampler)", 1, 1, "passed")]
    assert result["tests"][2]["output"] == "passed: ok [07b.ipynb]"  # the better notebook's
    assert result["tests"][0]["output"].startswith("not handed in")
    assert result["score"] == 4 and result["output"].startswith("4/5 points")
    bob = grading.gradescope_results([r for r in _rows() if r.student == "bob"], assignment)
    assert bob["score"] == 0 and "bob.ipynb: this notebook is chapter 1" in bob["output"]


def test_the_grade_command(tmp_path, monkeypatch, capsys):
    from dpcourse.harness.exercises.__main__ import main

    subs = tmp_path / "subs"
    (subs / "alice").mkdir(parents=True)
    (subs / "alice" / "07.ipynb").write_text("{}")
    (subs / "bob.ipynb").write_text("{}")
    seen = {}

    def fake_grade(submissions, assignment, timeout, cell_timeout, jobs, counts):
        seen.update(students=[s.student for s in submissions], assignment=assignment,
                    counts=counts)
        return [grading.GradeRow(s.student, s.name, "7", "ex-7-buckets", "passed", 2, 2, "ok")
                for s in submissions]

    monkeypatch.setattr(grading, "grade", fake_grade)
    out = tmp_path / "grades"
    assert main(["grade", str(subs), "--out", str(out), "--chapter", "7", "--points", "7.3=2",
                 "--gradescope-file", str(tmp_path / "results.json"),
                 "--course-code-counts"]) == 0
    assert seen["students"] == ["alice", "bob"] and seen["counts"]
    assert seen["assignment"].points_of("ex-7-buckets") == 2
    assert "2/6  alice" in capsys.readouterr().out
    tests = json.loads((tmp_path / "results.json").read_text())["tests"]
    assert next(t for t in tests if "ex-7-buckets" in t["name"])["max_score"] == 2
    assert main(["grade", str(subs), "--out", str(out), "--only", "bob"]) == 0
    assert seen["students"] == ["bob"]
    assert {r.student for r in grading.read_scores(out / "scores.csv")} == {"alice", "bob"}
    with pytest.raises(SystemExit):
        main(["grade", str(subs), "--only", "carol", "--out", str(out)])
    assert "no notebook of the student 'carol'" in capsys.readouterr().err


def test_messages_show_no_path_of_the_graders_machine():
    import dpcourse

    where = Path(dpcourse.__file__).resolve().parent / "harness" / "exercises" / "ch07.py"
    text = without_paths(f'File "{where}", line 268, in _average_on_rank; File "{torch.__file__}"')
    assert text == ('File "dpcourse/harness/exercises/ch07.py", line 268, in _average_on_rank; '
                    'File "torch/__init__.py"')


def test_student_data_stays_out_of_git():
    ignored = subprocess.run(
        ["git", "check-ignore", "submissions/alice.ipynb", "grades/scores.csv", "scores.csv",
         "gradescope/alice/results.json"], cwd=ROOT, capture_output=True, text=True)
    assert len(ignored.stdout.split()) == 4, ignored.stdout
    make = (ROOT / "Makefile").read_text()
    assert "GRADES ?= grades" in make and "--out $(GRADES)" in make


def test_the_gradescope_autograder_installs_the_pins_and_names_the_assignment(
        tmp_path, monkeypatch):
    import shlex
    import zipfile

    from dpcourse.harness.exercises.__main__ import main

    out = tmp_path / "autograder.zip"
    assert main(["autograder", "--root", str(ROOT), "--chapter", "7", "--points", "7.6=3",
                 "--out", str(out)]) == 0
    z = zipfile.ZipFile(out)
    names = z.namelist()
    assert names[:2] == ["setup.sh", "run_autograder"]
    assert "course/src/dpcourse/harness/exercises/grading.py" in names
    assert "course/pyproject.toml" in names and not any("__pycache__" in n for n in names)
    assert all(z.getinfo(n).external_attr >> 16 == 0o755 for n in names[:2])
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "requirements.txt").write_bytes(z.read("course/requirements.txt"))
    setup = z.read("setup.sh").decode().replace("/autograder/source/course", str(tmp_path /
                                                                                  "course"))
    # Each package the script installs, at requirements.txt's pin: run its pin() on each name.
    pin = next(line for line in setup.splitlines() if line.startswith("pin()"))
    asked = re.findall(r'"\$\(pin (\w+)\)"', setup)
    assert asked == ["torch", "numpy", "matplotlib", "cloudpickle", "ipykernel", "PyYAML"]
    pinned = subprocess.run(["bash", "-c", pin + "; for p in " + " ".join(asked)
                             + "; do pin $p; done"], capture_output=True, text=True).stdout
    requirements = (ROOT / "requirements.txt").read_text()
    assert pinned.split() == [re.search(rf"^{p}==\S+", requirements, re.M)[0] for p in asked]
    for script in ("setup.sh", "run_autograder"):
        assert subprocess.run(["bash", "-n", "-c", z.read(script).decode()]).returncode == 0
    # run_autograder's command, as the grader's command line takes it
    command = z.read("run_autograder").decode().split("python -m dpcourse.harness.exercises ")[1]
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:2] == ["grade", "/autograder/submission"]
    seen = {}

    def fake_grade(submissions, assignment, *rest):
        seen.update(assignment=assignment, students={s.student for s in submissions})
        return []

    monkeypatch.setattr(grading, "grade", fake_grade)
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "07_ddp.ipynb").write_text("{}")
    argv = [a.replace("/autograder/submission", str(tmp_path / "submission"))
            .replace("/autograder/results", str(tmp_path / "results"))
            .replace("/tmp/grades", str(tmp_path / "grades")) for a in argv]
    assert main(argv) == 0
    assert seen["students"] == {"submission"}
    assert seen["assignment"].exercises == grading.Assignment.of("7").exercises
    assert seen["assignment"].points_of("ex-7-bucketed-ddp") == 3
    result = json.loads((tmp_path / "results" / "results.json").read_text())
    assert len(result["tests"]) == 5 and result["score"] == 0
