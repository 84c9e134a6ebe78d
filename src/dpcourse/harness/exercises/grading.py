"""Grading submitted notebooks: ``python -m dpcourse.harness.exercises grade SUBMISSIONS...``.

Every submission is read into memory before any is graded; which student it is comes from its
folder or file name (:func:`find_submissions`), and which exercises count from the assignment
(:class:`Assignment`: a chapter, or a list of exercises): a notebook of another chapter is
refused, saying which it is. Each notebook goes to a judge
(:mod:`~dpcourse.harness.exercises.judge`, a process that never runs a learner's code), which runs
each exercise's function, with only what it needs of the notebook, in a process of its own, and
checks it where that code cannot reach the verdict wherever the exercise allows. Nothing the
notebook wrote (its outputs, its own check cells, a log) is read. ``jobs`` judges work side by
side.

Records (:func:`write_records`), in a folder outside the repository or ignored by git:
``scores.csv`` (a row per student, notebook and exercise, with points), ``totals.csv`` (a row per
student: what a learning management system imports), ``feedback/<student>.html`` (each check's
message, the errors in the student's cells and what their code printed) and, for Gradescope,
a ``results.json`` in its autograder format (:func:`gradescope_results`). Regrading one student
(``only=``) replaces that student's rows and keeps everyone else's.

Chapter 0: the exercise checks of the whole course.
"""

from __future__ import annotations

import csv
import html
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import dpcourse
from dpcourse.harness.exercises import numbering
from dpcourse.harness.exercises.core import exercise_title, registry

__all__ = [
    "Assignment", "Submission", "GradeRow", "chapter_of", "find_submissions", "grade",
    "write_records", "read_scores", "totals", "gradescope_results", "feedback_html",
]

DEFAULT_TIMEOUT = 900.0  # seconds for one whole notebook
DEFAULT_CELL_TIMEOUT = 300.0
# Seconds a judge may take beyond a notebook's time limit before the grader stops it: starting
# and stopping processes, and a check started just before the limit, which runs to its own
# (180 s at most) plus the judge's margin for a check in the player (judge.LOCAL_MARGIN).
JUDGE_MARGIN = 300.0
SCORE_COLUMNS = ["student", "submission", "chapter", "exercise", "number", "status", "points",
                 "max_points", "message"]


def _part_name(part: str) -> str:
    return f"chapter {part}" if part.isdigit() else f"the appendix {part!r}"


@dataclass(frozen=True)
class Assignment:
    """What an assignment counts: its exercises (labels, in the book's order) and the points of
    each (1 unless given)."""

    exercises: tuple[str, ...]
    points: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, chapter: str | None = None, exercises: list[str] | None = None,
           points: dict[str, float] | None = None) -> Assignment:
        """The checked exercises of ``chapter`` ("7", "lab", "bugs"), or the ``exercises``
        named by label or number ("ex-7-buckets", "7.1"); a ``ValueError`` that lists what
        there is for anything else."""
        every = registry()
        checked = [label for label, ex in every.items() if ex.function]
        chosen: list[str] = []
        if chapter is not None:
            part = str(int(chapter)) if str(chapter).isdigit() else str(chapter)
            chosen = [label for label in checked if every[label].part == part]
            if not chosen:
                parts = sorted({every[label].part for label in checked}, key=_part_order)
                raise ValueError(f"{_part_name(part)} has no checked exercises; those that "
                                 f"have: {', '.join(parts)}")
        by_number = {numbering.number_of(label): label for label in checked}
        for name in exercises or []:
            label = name if name in every else by_number.get(name)
            if label is None or label not in checked:
                raise ValueError(f"no checked exercise {name!r}: `python -m "
                                 "dpcourse.harness.exercises list` lists them")
            if label not in chosen:
                chosen.append(label)
        if not chosen:
            raise ValueError("an assignment needs a chapter or exercises")
        order = list(every)
        chosen.sort(key=order.index)
        points = dict(points or {})
        for label, value in points.items():
            if label not in chosen:
                raise ValueError(f"points for {label!r}, which is not in the assignment "
                                 f"({', '.join(chosen)})")
            if isinstance(value, bool) or not value >= 0:
                raise ValueError(f"points must be a number of 0 or more, got {value!r}")
        return cls(tuple(chosen), points)

    def points_of(self, label: str) -> float:
        return float(self.points.get(label, 1))

    def parts(self) -> list[str]:
        return list(dict.fromkeys(registry()[label].part for label in self.exercises))


def _part_order(part: str) -> tuple[int, str]:
    return (int(part), "") if part.isdigit() else (10_000, part)


@dataclass
class Submission:
    """One notebook handed in: whose it is, its name as the records show it, its bytes."""

    student: str
    name: str
    content: bytes


@dataclass
class GradeRow:
    """One exercise of one notebook of one student (``exercise`` is "-" for a notebook that
    could not be graded at all, with the reason as ``message``)."""

    student: str
    submission: str
    chapter: str
    exercise: str
    status: str
    points: float
    max_points: float
    message: str
    # For the feedback file only: where it was checked ("apart", in the judge, or "local", in
    # the player), the cells that ran, the errors in them, what the code printed.
    mode: str = ""
    cells: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    output: str = ""

    @property
    def number(self) -> str:
        return (numbering.number_of(self.exercise) or "") if self.exercise != "-" else ""


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


def find_submissions(paths: list[Path], student: str | None = None,
                     student_pattern: str | None = None) -> list[Submission]:
    """Every notebook under ``paths`` (files, or folders of them; hidden folders such as
    ``.ipynb_checkpoints/`` are skipped), read now, with its student: ``student`` for all of
    them if given (an autograder's one submission); else the first group of the regular
    expression ``student_pattern`` found in the notebook's path below the folder given (an
    LMS's bulk download: ``^([^_]+)_`` for ``alice_07_ddp.ipynb``); else the folder the notebook
    is in, below a folder given (``submissions/alice/07_ddp.ipynb``), or the file's name
    without ``.ipynb``."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    missing = [str(p) for p in map(Path, paths) if not p.exists()]
    if missing:
        raise FileNotFoundError(f"no such submission: {', '.join(missing)} (pass notebooks, or "
                                "folders of them)")
    pattern = re.compile(student_pattern) if student_pattern else None
    if pattern is not None and pattern.groups < 1:
        raise ValueError(f"--student-pattern needs a group, the student's part: "
                         f"{student_pattern!r}")
    found: list[tuple[Path, Path]] = []  # (file, what it was found under)
    for p in map(Path, paths):
        if not p.is_dir():
            found.append((p, p.parent))
            continue
        found += [(f, p) for f in sorted(p.rglob("*.ipynb"))
                  if not any(part.startswith(".") for part in f.relative_to(p).parts)]
    submissions = []
    for f, base in found:
        rel = f.relative_to(base)
        if student is not None:
            who = student
        elif pattern is not None:
            m = pattern.search(rel.as_posix())
            if not m or not m.group(1):
                raise ValueError(f"--student-pattern {student_pattern!r} finds no student in "
                                 f"{rel.as_posix()!r}")
            who = m.group(1)
        elif len(rel.parts) > 1:
            who = rel.parts[0]
        else:
            who = f.stem
        submissions.append(Submission(who, str(f), f.read_bytes()))
    return submissions


# ------------------------------------------------------------------------------------- judges
class _Judge:
    """A judge process (:func:`dpcourse.harness.exercises.judge.main`) and its pipes: one
    per job, reused for the job's submissions, replaced if it fails."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="dpcourse-grader-"))
        self.log = open(self.home / "judge.log", "wb")
        env = {k: v for k, v in os.environ.items() if k != "DPCOURSE_CHECKS_STRICT"}
        # -I: neither the working folder nor PYTHONPATH on the path, so that no file a
        # submission writes can stand in for a module the judge imports later; the folder this
        # process found dpcourse in goes first, so that the judge runs the same grader.
        package_root = str(Path(dpcourse.__file__).resolve().parents[1])
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {package_root!r}); "
             "from dpcourse.harness.exercises.judge import main; main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, cwd=self.home,
            env=env, start_new_session=True,
        )

    def ask(self, request: dict, timeout: float) -> dict | None:
        """The judge's answer to ``request``, or None if it failed or took over ``timeout``."""
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else b""
            return json.loads(line) if line else None
        except (OSError, ValueError):
            return None

    def failure(self) -> str:
        self.log.flush()
        text = (self.home / "judge.log").read_bytes()[-1500:].decode(errors="replace")
        return " / ".join(text.strip().splitlines()[-3:])

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.home, ignore_errors=True)


def _grade_one(judge_slot: list, sub: Submission, assignment: Assignment | None,
               options: dict) -> list[GradeRow]:
    def refused(chapter: str, why: str) -> list[GradeRow]:
        return [GradeRow(sub.student, sub.name, chapter, "-", "not run", 0, 0, why)]

    try:
        nb = json.loads(sub.content)
        if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
            raise ValueError("no cells")
        chapter = chapter_of(nb, sub.name)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return refused("-", f"not a notebook: {exc}")
    every = registry()
    if assignment is None:
        if chapter is None:
            return refused("-", "cannot tell which chapter this is: keep the exercise cells, or "
                           "name the file after the chapter (01_single_device.ipynb)")
        labels = [label for label, ex in every.items() if ex.part == chapter and ex.function]
        if not labels:
            return refused(chapter, f"{_part_name(chapter)} has no checked exercises")
    else:
        if chapter is None and len(assignment.parts()) == 1:
            chapter = assignment.parts()[0]  # no labels left, no telling name: try the assignment
        labels = [label for label in assignment.exercises if every[label].part == chapter]
        if not labels:
            asked = ", ".join(_part_name(p) for p in assignment.parts())
            what = _part_name(chapter) if chapter else "a notebook of no chapter the grader knows"
            return refused(chapter or "-", f"this notebook is {what}, but the assignment is "
                           f"{asked}: hand in that chapter's notebook")
    request = {"notebook": sub.content.decode(errors="replace"), "exercises": labels, **options}
    if judge_slot[0] is None:
        judge_slot[0] = _Judge()
    answer = judge_slot[0].ask(request, options["timeout"] + JUDGE_MARGIN)
    if answer is None:
        why = judge_slot[0].failure() or "no answer"
        judge_slot[0].close()
        judge_slot[0] = None
        return [GradeRow(sub.student, sub.name, chapter, label, "error", 0,
                         _points(assignment, label),
                         f"the grader failed on this notebook ({why}); please report it")
                for label in labels]
    rows = []
    for v in answer["verdicts"]:
        full = _points(assignment, v["label"])
        message = v["message"]
        if v["status"] != "passed" and v["problems"]:
            message += f" [errors in the cells it needs: {'; '.join(v['problems'][:3])}]"
        rows.append(GradeRow(sub.student, sub.name, chapter, v["label"], v["status"],
                             full if v["status"] == "passed" else 0, full, message,
                             v["mode"], v["cells"], v["problems"], v["output"]))
    return rows


def _points(assignment: Assignment | None, label: str) -> float:
    return assignment.points_of(label) if assignment else 1.0


def grade(
    submissions: list[Submission] | list[Path],
    assignment: Assignment | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    cell_timeout: float = DEFAULT_CELL_TIMEOUT,
    jobs: int = 1,
    course_code_counts: bool = False,
) -> list[GradeRow]:
    """Grade ``submissions`` (from :func:`find_submissions`, or paths to find them under): one
    row per notebook and exercise, in the order given. Without an ``assignment`` each notebook
    is graded on the checked exercises of its own chapter. ``timeout`` bounds each notebook,
    ``cell_timeout`` each cell it runs; ``jobs`` notebooks are graded at once;
    ``course_code_counts`` scores answers that are the course's own functions."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive number of submissions at once, got {jobs!r}")
    for name, value in (("timeout", timeout), ("cell_timeout", cell_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds above 0, got {value!r}")
    if not all(isinstance(s, Submission) for s in submissions):
        submissions = find_submissions([Path(p) for p in submissions])
    options = {"timeout": float(timeout), "cell_timeout": float(cell_timeout),
               "course_code_counts": bool(course_code_counts)}
    results: list[list[GradeRow] | None] = [None] * len(submissions)
    queue = list(enumerate(submissions))
    lock = threading.Lock()

    def work() -> None:
        slot: list = [None]  # this worker's judge, started at its first notebook
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    i, sub = queue.pop(0)
                results[i] = _grade_one(slot, sub, assignment, options)
        finally:
            if slot[0] is not None:
                slot[0].close()

    workers = [threading.Thread(target=work) for _ in range(min(jobs, len(submissions)))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return [row for rows in results for row in rows or []]


# ------------------------------------------------------------------------------------ records
def _safe_name(text: str) -> str:
    return re.sub(r"[^\w.-]+", "_", text).strip("._") or "student"


def read_scores(path: Path) -> list[GradeRow]:
    """The rows of a ``scores.csv`` that :func:`write_records` wrote."""
    with open(path, newline="") as f:
        return [GradeRow(r["student"], r["submission"], r["chapter"], r["exercise"], r["status"],
                         float(r["points"]), float(r["max_points"]), r["message"])
                for r in csv.DictReader(f)]


def totals(rows: list[GradeRow], assignment: Assignment | None = None
           ) -> dict[str, dict[str, float]]:
    """Each student's points per exercise (the best over their notebooks), by student, with
    ``"total"`` and ``"max"``; every exercise of the assignment counts toward ``"max"``, handed
    in or not."""
    best: dict[str, dict[str, float]] = {}
    full: dict[str, float] = (
        {label: assignment.points_of(label) for label in assignment.exercises}
        if assignment else {})
    for r in rows:
        mine = best.setdefault(r.student, {})
        if r.exercise != "-":
            mine[r.exercise] = max(mine.get(r.exercise, 0.0), r.points)
            full.setdefault(r.exercise, r.max_points)
    out = {}
    for student, points in best.items():
        counted = full if assignment else {k: full[k] for k in points}
        out[student] = {**{k: points.get(k, 0.0) for k in counted},
                        "total": sum(points.get(k, 0.0) for k in counted),
                        "max": sum(counted.values())}
    return out


def _number(value: float) -> str:
    return f"{value:g}"


def gradescope_results(rows: list[GradeRow], assignment: Assignment | None = None) -> dict:
    """One student's rows as Gradescope's autograder wants them in ``results.json``: a test per
    exercise (the best of the student's notebooks), worth its points, whose output is what the
    check said; every exercise of the assignment, handed in or not; the total as ``score``.
    Notebooks that could not be graded give no test, only a line of the top-level output."""
    labels = list(assignment.exercises) if assignment else []
    for r in rows:
        if r.exercise != "-" and r.exercise not in labels:
            labels.append(r.exercise)
    tests, notes = [], []
    for r in rows:
        if r.exercise == "-":
            notes.append(f"{Path(r.submission).name}: {r.message}")
    for label in labels:
        mine = [r for r in rows if r.exercise == label]
        full = assignment.points_of(label) if assignment else max(r.max_points for r in mine)
        if mine:
            r = max(mine, key=lambda r: r.points)
            names = {Path(x.submission).name for x in rows if x.exercise != "-"}
            where = f" [{Path(r.submission).name}]" if len(names) > 1 else ""
            output = (f"{r.status}: {r.message}" if r.message else r.status) + where
            score, status = r.points, "passed" if r.status == "passed" else "failed"
        else:
            output, score, status = "not handed in: no notebook of its chapter", 0.0, "failed"
        tests.append({"name": exercise_title(label), "score": score, "max_score": full,
                      "status": status, "output": output})
    score = sum(t["score"] for t in tests)
    summary = (f"{_number(score)}/{_number(sum(t['max_score'] for t in tests))} points from "
               "the checked exercises")
    return {"score": score, "output": "\n".join([summary, *notes]), "tests": tests}


def feedback_html(student: str, rows: list[GradeRow]) -> str:
    """A student's feedback page: each exercise's status, points and message, the errors in the
    cells it needed, the cells that ran and what the student's code printed."""
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>Feedback: {esc(student)}</title>",
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "td,th{border-bottom:1px solid #ccc;padding:4px 8px;vertical-align:top;text-align:left}"
        "pre{white-space:pre-wrap;background:#f6f8fa;padding:6px}"
        ".passed{color:#1a7f37}.failed,.missing,.error{color:#cf222e}</style></head><body>",
        f"<h1>Feedback for {esc(student)}</h1>",
    ]
    for name in dict.fromkeys(r.submission for r in rows):
        mine = [r for r in rows if r.submission == name]
        got = sum(r.points for r in mine)
        full = sum(r.max_points for r in mine)
        parts.append(f"<h2>{esc(Path(name).name)}: {_number(got)}/{_number(full)} points</h2>")
        parts.append("<table><tr><th>Exercise</th><th>Status</th><th>Points</th>"
                     "<th>What the check said</th></tr>")
        for r in mine:
            title = exercise_title(r.exercise) if r.exercise != "-" else "(the notebook)"
            cls = re.sub(r"\W", "", r.status.split()[0]) if r.status else ""
            parts.append(f"<tr><td>{esc(title)}</td><td class='{cls}'>{esc(r.status)}</td>"
                         f"<td>{_number(r.points)}/{_number(r.max_points)}</td>"
                         f"<td>{esc(r.message)}</td></tr>")
        parts.append("</table>")
        for r in mine:
            if not (r.problems or r.output or r.cells):
                continue
            parts.append(f"<h3>{esc(exercise_title(r.exercise))}</h3>")
            if r.cells:
                parts.append("<p>The grader ran only the code this exercise needs, from:</p><ul>"
                             + "".join(f"<li>{esc(c)}</li>" for c in r.cells) + "</ul>")
            if r.problems:
                parts.append("<p>Errors in those cells:</p><ul>"
                             + "".join(f"<li>{esc(p)}</li>" for p in r.problems) + "</ul>")
            if r.output.strip():
                parts.append(f"<p>What your code printed (the end):</p><pre>{esc(r.output)}</pre>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_records(rows: list[GradeRow], out: Path, assignment: Assignment | None = None,
                  only: str | None = None) -> list[Path]:
    """Write ``scores.csv``, ``totals.csv`` and ``feedback/<student>.html`` under the folder
    ``out``; with ``only`` (a regrade of that student), the existing ``scores.csv`` keeps every
    other student's rows. The files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    scores = out / "scores.csv"
    if only is not None and scores.exists():
        rows = [r for r in read_scores(scores) if r.student != only] + list(rows)
        rows.sort(key=lambda r: r.student)
    with open(scores, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SCORE_COLUMNS)
        for r in rows:
            writer.writerow([r.student, r.submission, r.chapter, r.exercise, r.number, r.status,
                             _number(r.points), _number(r.max_points), r.message])
    table = totals(rows, assignment)
    labels = list(assignment.exercises) if assignment else list(dict.fromkeys(
        r.exercise for r in rows if r.exercise != "-"))
    with open(out / "totals.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["student", "total", "max", *labels])
        for student, t in table.items():
            writer.writerow([student, _number(t["total"]), _number(t["max"]),
                             *(_number(t[k]) if k in t else "" for k in labels)])
    written = [scores, out / "totals.csv"]
    feedback = out / "feedback"
    feedback.mkdir(exist_ok=True)
    for student in dict.fromkeys(r.student for r in rows if only is None or r.student == only):
        page = feedback / f"{_safe_name(student)}.html"
        page.write_text(feedback_html(student, [r for r in rows if r.student == student]))
        written.append(page)
    return written
