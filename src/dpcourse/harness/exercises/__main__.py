"""Instructor commands: ``python -m dpcourse.harness.exercises
{student,edition,grade,autograder,list,numbers}``.

Chapter 0: the course's tooling (appendix A, the instructor guide, explains it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dpcourse.harness.exercises import (
    autograder,
    exercise_numbers,
    grading,
    numbering,
    registry,
)
from dpcourse.harness.exercises.student import make_executed_edition, make_student_edition


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dpcourse.harness.exercises", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("student", help="write the student edition of the book's sources")
    p.add_argument("--root", default=".", help="the book (folder with _config.yml)")
    p.add_argument("--out", default="_build/student", help="where to write it")
    p.add_argument(
        "--executed",
        default=None,
        help="take the notebooks with their outputs from this folder (`make notebooks` fills "
        "it), so that the edition renders them without running them again",
    )

    p = sub.add_parser(
        "edition", help="write the full edition's sources with the executed notebooks"
    )
    p.add_argument("--root", default=".", help="the book (folder with _config.yml)")
    p.add_argument("--executed", default="_build/executed", help="the executed notebooks")
    p.add_argument("--out", default="_build/full", help="where to write it")

    p = sub.add_parser(
        "grade", help="grade submitted notebooks: scores, totals and feedback per student")
    p.add_argument("submissions", nargs="+",
                   help="notebooks, or folders of them (a folder per student, or a file each)")
    p.add_argument("--out", default="grades",
                   help="the folder for scores.csv, totals.csv and feedback/ (default: grades, "
                   "which the course's repository ignores)")
    p.add_argument("--chapter", help="the assignment is this chapter's checked exercises "
                   "(7, lab, bugs); a notebook of another chapter is refused")
    p.add_argument("--exercises", help="the assignment is these exercises, by label or number, "
                   "comma-separated (ex-7-buckets,7.3)")
    p.add_argument("--points", action="append", default=[], metavar="EXERCISE=N",
                   help="the points of an exercise (1 unless given); repeat for each")
    p.add_argument("--student", help="every notebook given is this student's (an autograder's "
                   "one submission)")
    p.add_argument("--student-pattern", metavar="REGEX",
                   help="the student is this regular expression's first group, found in the "
                   "notebook's path below the folder given (^([^_]+)_ for alice_07_ddp.ipynb); "
                   "default: the folder below the one given, else the file's name")
    p.add_argument("--only", metavar="STUDENT",
                   help="regrade this student alone: their rows replace theirs in the existing "
                   "scores.csv, everyone else's are kept")
    p.add_argument("--course-code-counts", action="store_true",
                   help="score answers that are, or call, the course's own function for the "
                   "exercise (by default they are reported and get no points)")
    p.add_argument(
        "--gradescope-file",
        metavar="FILE",
        help="also write everything graded as one Gradescope submission's results.json "
        "(an autograder's run_autograder: /autograder/results/results.json)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=grading.DEFAULT_TIMEOUT,
        help="seconds for one whole notebook",
    )
    p.add_argument(
        "--cell-timeout",
        type=float,
        default=grading.DEFAULT_CELL_TIMEOUT,
        help="seconds for one cell",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=max(1, min(4, os.cpu_count() or 1)),
        help="submissions graded at once (default: the CPU cores, at most 4)",
    )

    p = sub.add_parser(
        "autograder", help="write a Gradescope autograder (a zip) for one assignment")
    p.add_argument("--root", default=".", help="the course's repository")
    p.add_argument("--out", default="autograder.zip", help="the zip file to write")
    p.add_argument("--chapter", help="the assignment is this chapter's checked exercises")
    p.add_argument("--exercises", help="the assignment is these exercises, by label or number")
    p.add_argument("--points", action="append", default=[], metavar="EXERCISE=N",
                   help="the points of an exercise (1 unless given); repeat for each")
    p.add_argument("--course-code-counts", action="store_true",
                   help="score answers that are, or call, the course's own function")

    sub.add_parser("list", help="list the exercises that have checks, with their numbers and "
                   "where the grader checks them")

    p = sub.add_parser(
        "numbers",
        help="the exercises' numbers from the pages (see dpcourse.harness.exercises.numbering)",
    )
    p.add_argument("--root", default=".", help="the book (folder with _toc.yml)")
    p.add_argument(
        "--write", action="store_true", help="write them into exercise_numbers.py",
    )
    args = parser.parse_args(argv)

    if args.command in ("student", "edition"):
        executed = Path(args.executed) if args.executed else None
        try:
            if args.command == "student":
                notebooks = make_student_edition(Path(args.root), Path(args.out), executed)
            else:
                notebooks = make_executed_edition(Path(args.root), Path(args.out), executed)
        except FileNotFoundError as exc:
            print(exc, file=sys.stderr)
            return 1
        what = "student edition" if args.command == "student" else "full edition"
        print(f"{what} written to {args.out} ({len(notebooks)} notebooks)")
        for nb in notebooks:
            print(f"  {nb}")
    elif args.command == "autograder":
        try:
            if not (args.chapter or args.exercises):
                raise ValueError("name the assignment: --chapter or --exercises")
            _assignment(args)  # a ValueError for an assignment that names nothing checked
            forwarded = [*(["--chapter", args.chapter] if args.chapter else []),
                         *(["--exercises", args.exercises] if args.exercises else []),
                         *(a for item in args.points for a in ("--points", item)),
                         *(["--course-code-counts"] if args.course_code_counts else [])]
            names = autograder.write_autograder(Path(args.root), Path(args.out), forwarded)
        except (ValueError, FileNotFoundError) as exc:
            parser.error(f"autograder: {exc}")
        print(f"{args.out}: setup.sh, run_autograder and the course's package "
              f"({len(names) - 2} files); the instructor guide's Gradescope section says more")
    elif args.command == "grade":
        try:
            assignment = _assignment(args)
            submissions = grading.find_submissions(
                [Path(s) for s in args.submissions], args.student, args.student_pattern)
            if args.only is not None:
                submissions = [s for s in submissions if s.student == args.only]
                if not submissions:
                    raise ValueError(f"no notebook of the student {args.only!r} among the "
                                     "submissions given")
            rows = grading.grade(submissions, assignment, args.timeout, args.cell_timeout,
                                 args.jobs, args.course_code_counts)
        except (ValueError, FileNotFoundError) as exc:
            parser.error(f"grade: {exc}")
        written = grading.write_records(rows, Path(args.out), assignment, args.only)
        if args.gradescope_file:
            target = Path(args.gradescope_file)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(
                json.dumps(grading.gradescope_results(rows, assignment), indent=1) + "\n")
        for student, t in grading.totals(rows, assignment).items():
            print(f"{t['total']:g}/{t['max']:g}  {student}")
        print(f"scores, totals and feedback written to {written[0].parent}")
    elif args.command == "numbers":
        try:
            numbers = numbering.numbers_in_book(Path(args.root))
        except (ValueError, FileNotFoundError) as exc:
            print(exc, file=sys.stderr)
            return 1
        for label, number in numbers.items():
            print(f"Exercise {number:<8} {label}")
        if args.write:
            changed = numbering.write_table(Path(args.root))
            print(f"{numbering.TABLE_MODULE}: {'written' if changed else 'already up to date'}")
        elif numbers != exercise_numbers.NUMBERS:
            print(f"{numbering.TABLE_MODULE} differs from the pages: run this with --write",
                  file=sys.stderr)
            return 1
    else:
        # import here: grading's
        from dpcourse.harness.exercises.judge import judged_apart  # noqa: PLC0415

        for ex in registry().values():
            where = "judged apart" if judged_apart(ex.label) else "checked in the player"
            print(f"Exercise {ex.number or '?':<8} {ex.label:<22} "
                  f"{'check.' + ex.name + '(' + (ex.function or '...') + ')':<58} {where}")
    return 0


def _assignment(args: argparse.Namespace) -> grading.Assignment | None:
    """The assignment that ``--chapter``, ``--exercises`` and ``--points`` name, if any."""
    points = {}
    for item in args.points:
        label, _, value = item.partition("=")
        try:
            points[label] = float(value)
        except ValueError:
            raise ValueError(f"--points takes EXERCISE=N, got {item!r}") from None
    if not (args.chapter or args.exercises or points):
        return None
    exercises = [e.strip() for e in (args.exercises or "").split(",") if e.strip()]
    numbered = {str(numbering.number_of(label)): label for label in registry()}
    points = {numbered.get(k, k): v for k, v in points.items()}
    return grading.Assignment.of(args.chapter, exercises, points)


if __name__ == "__main__":
    sys.exit(main())
