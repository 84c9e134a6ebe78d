"""Grading submitted notebooks: ``python -m dpcourse.harness.exercises grade SUBMISSIONS... --out
F``.

Each submission is executed on its own, in a fresh temporary folder (also its ``HOME``), in a
process session of its own with a time limit, so a notebook that loops forever, crashes its
kernel or deletes files cannot stop the grading of the others: every submission is read into
memory before any runs, and whatever a run leaves behind is killed and removed.

The grader does not trust the notebook's own check cells. After the last cell it runs the
chapter's checks itself, in the same kernel, on the functions the exercises name
(``my_chunk_data`` and so on), and records one row per exercise: ``passed``, ``failed``,
``not attempted`` (the student edition's stub is still there), ``missing`` (the function was
never defined) or ``not run`` (the notebook did not get that far). Scores go to a CSV file
and, for Gradescope, to a ``results.json`` per submission in its autograder format
(:func:`gradescope_results`; the instructor guide says how to upload the grader).

Chapter 0: the exercise checks of the whole course.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dpcourse.harness.exercises import numbering
from dpcourse.harness.exercises.core import LOG_ENV, CheckResult, log_result, registry, run_check

__all__ = [
    "GradeRow", "grade", "chapter_of", "write_csv", "gradescope_results", "write_gradescope",
]

DEFAULT_TIMEOUT = 900.0  # seconds for one whole notebook
DEFAULT_CELL_TIMEOUT = 300.0


@dataclass
class GradeRow:
    submission: str
    chapter: str  # the labels' part: a chapter's number ("5") or an appendix's name ("lab")
    exercise: str
    status: str
    score: int
    message: str


def chapter_of(nb: dict, name: str) -> str | None:
    """Which part of the book a notebook is, as its exercise labels name it ("5" for chapter 5,
    "lab" for the diagnosis lab, "bugs" for find the bugs): its labels, else its file name (a
    leading number, or the appendix page's name)."""
    text = "\n".join(
        "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        for c in nb.get("cells", [])
    )
    found = {str(int(m)) if m.isdigit() else m
             for m in re.findall(r":label:\s*ex-(\d+|[a-z]+)-", text)}
    if len(found) == 1:
        return found.pop()
    m = re.match(r"(\d+)", Path(name).name)
    if m:
        return str(int(m.group(1)))
    return next((part for part, (_, page) in numbering.APPENDICES.items()
                 if page in Path(name).stem), None)


_GRADING_CELL = """
from dpcourse.harness.exercises import grading as _dpcourse_grading
_dpcourse_grading.check_namespace(globals(), {chapter!r})
"""


def check_namespace(namespace: dict, chapter: str) -> None:
    """Run every check of ``chapter`` (a part of the book as labels name it: "5", "lab") on the
    learner's functions found in ``namespace`` (the grading cell appended to a submission calls
    it); results go to the grade log."""

    for ex in registry().values():
        if ex.part != str(chapter) or not ex.function:
            continue
        fn = namespace.get(ex.function)
        if fn is None:
            result = CheckResult(
                ex.label,
                ex.name,
                "missing",
                f"no function called {ex.function!r} was defined "
                "(was its cell deleted, renamed, or did an earlier cell fail?)",
            )
        else:
            result = run_check(ex.label, fn)
        log_result(result)


def _run_notebook(nb_path: Path, log_path: Path, cell_timeout: float) -> None:
    """Execute one notebook (in a child process started by :func:`grade`)."""
    import nbclient  # import here: optional (the notebooks extra), only for grading
    import nbformat  # import here: optional (the notebooks extra), only for grading

    nb = nbformat.read(nb_path, as_version=4)
    nb.cells.append(
        nbformat.v4.new_code_cell(
            _GRADING_CELL.format(chapter=os.environ["DPCOURSE_GRADE_CHAPTER"])
        )
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=int(cell_timeout),
        interrupt_on_timeout=True,
        allow_errors=True,
        kernel_name="python3",
        resources={"metadata": {"path": str(nb_path.parent)}},
    )
    client.execute()
    errors = [
        f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    with open(log_path, "a") as f:
        f.write(json.dumps({"notebook_errors": errors}) + "\n")


def _grade_one(name: str, content: bytes, timeout: float, cell_timeout: float) -> list[GradeRow]:
    try:
        nb = json.loads(content)
        chapter = chapter_of(nb, name)
    except (ValueError, KeyError, TypeError) as exc:
        return [GradeRow(name, "-", "-", "not run", 0, f"not a notebook: {exc}")]
    if chapter is None:
        return [
            GradeRow(
                name,
                "-",
                "-",
                "not run",
                0,
                "cannot tell which chapter this is: keep the exercise cells, or name "
                "the file after the chapter (01_single_device.ipynb)",
            )
        ]
    exercises = [ex for ex in registry().values() if ex.part == chapter and ex.function]
    if not exercises:
        what = f"chapter {chapter}" if chapter.isdigit() else f"the appendix {chapter!r}"
        return [GradeRow(name, chapter, "-", "not run", 0, f"{what} has no checked exercises")]

    work = Path(tempfile.mkdtemp(prefix="dpcourse-grade-"))
    try:
        nb_path = work / "submission.ipynb"
        nb_path.write_bytes(content)
        log_path = work / "grade-log.jsonl"
        env = dict(os.environ, HOME=str(work), DPCOURSE_GRADE_CHAPTER=chapter)
        env[LOG_ENV] = str(log_path)
        env.pop("DPCOURSE_CHECKS_STRICT", None)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from pathlib import Path; from dpcourse.harness.exercises import "
                "grading; "
                "grading._run_notebook(Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]))",
                str(nb_path),
                str(log_path),
                str(cell_timeout),
            ],
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        problem = ""
        try:
            output, _ = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                tail = output.decode(errors="replace").strip().splitlines()[-3:]
                problem = f"the notebook could not be run: {' / '.join(tail)}"
        except subprocess.TimeoutExpired:
            problem = f"the notebook did not finish within {timeout:g} s and was stopped"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the kernel and anything it started
            except ProcessLookupError:
                pass
            proc.wait()

        results: dict[str, dict] = {}
        errors: list[str] = []
        if log_path.exists():
            for line in log_path.read_text().splitlines():
                record = json.loads(line)
                if "notebook_errors" in record:
                    errors = record["notebook_errors"]
                elif "label" in record:
                    results[record["label"]] = record  # the grader's own check comes last
        rows = []
        for ex in exercises:
            r = results.get(ex.label)
            if r is None:
                why = problem or "the grading cell did not run"
                rows.append(GradeRow(name, chapter, ex.label, "not run", 0, why))
                continue
            message = r["message"]
            if r["status"] != "passed" and errors:
                message += f" [errors in the notebook: {'; '.join(errors[:3])}]"
            rows.append(
                GradeRow(
                    name, chapter, ex.label, r["status"], int(r["status"] == "passed"), message
                )
            )
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def grade(
    paths: list[Path],
    timeout: float = DEFAULT_TIMEOUT,
    cell_timeout: float = DEFAULT_CELL_TIMEOUT,
    jobs: int = 1,
) -> list[GradeRow]:
    """Grade notebooks (files, or folders of ``*.ipynb``); one row per submission and exercise,
    in the order of the files. ``jobs`` submissions run at once (each in its own kernel)."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive number of submissions at once, got {jobs!r}")
    for name, value in (("timeout", timeout), ("cell_timeout", cell_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds above 0, got {value!r}")
    if isinstance(paths, (str, Path)):
        paths = [paths]  # one path given alone
    missing = [str(p) for p in map(Path, paths) if not p.exists()]
    if missing:
        raise FileNotFoundError(f"no such submission: {', '.join(missing)} (pass notebooks, or "
                                "folders of them)")
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            files.append(p)
            continue
        # Not Jupyter's .ipynb_checkpoints/ copies (or any hidden folder's) of an uploaded folder.
        files += [f for f in sorted(p.rglob("*.ipynb"))
                  if not any(part.startswith(".") for part in f.relative_to(p).parts)]
    # Read everything first: a submission that deletes files cannot take the others with it.
    contents = [(str(f), f.read_bytes()) for f in files]
    with ThreadPoolExecutor(jobs) as pool:  # threads suffice: each submission is a process
        graded = pool.map(lambda c: _grade_one(c[0], c[1], timeout, cell_timeout), contents)
        return [row for rows in graded for row in rows]


def write_csv(rows: list[GradeRow], out: Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["submission", "chapter", "exercise", "status", "score", "message"])
        for r in rows:
            writer.writerow([r.submission, r.chapter, r.exercise, r.status, r.score, r.message])


def gradescope_results(rows: list[GradeRow]) -> dict:
    """The rows of one submission (a notebook, or every notebook of one upload) as Gradescope's
    autograder wants them in ``results.json``: a test per exercise, worth 1 point, its output
    what the check said; the total as ``score``. A notebook that could not be graded at all
    (not a notebook, no chapter) gives no test, only the top-level ``output``."""
    several = len({r.submission for r in rows}) > 1
    tests, notes = [], []
    for r in rows:
        where = Path(r.submission).name
        if r.exercise == "-":  # nothing in this notebook could be graded
            notes.append(f"{where}: {r.message}")
            continue
        tests.append({
            "name": f"{r.exercise} ({where})" if several else r.exercise,
            "score": r.score,
            "max_score": 1,
            # Gradescope knows passed and failed; the output keeps the grader's own status.
            "status": "passed" if r.status == "passed" else "failed",
            "output": f"{r.status}: {r.message}" if r.message else r.status,
        })
    score = sum(t["score"] for t in tests)
    summary = f"{score}/{len(tests)} checked exercises passed"
    return {"score": score, "output": "\n".join([summary, *notes]), "tests": tests}


def write_gradescope(rows: list[GradeRow], out: Path) -> list[Path]:
    """One Gradescope ``results.json`` per submitted notebook under ``out``, in folders named
    after the notebooks' paths below their common folder (``out/alice_01/results.json``)."""
    by_submission: dict[str, list[GradeRow]] = {}
    for r in rows:
        by_submission.setdefault(r.submission, []).append(r)
    paths = [Path(name).resolve() for name in by_submission]
    common = Path(os.path.commonpath([p.parent for p in paths])) if paths else Path()
    written = []
    for path, group in zip(paths, by_submission.values(), strict=True):
        target = Path(out) / path.relative_to(common).with_suffix("") / "results.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(gradescope_results(group), indent=1) + "\n")
        written.append(target)
    return written
