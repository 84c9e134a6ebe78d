"""Instructor commands: ``python -m dpcourse.harness.exercises
{student,edition,grade,list,numbers}``.

Chapter 0: the course's tooling (appendix A, the instructor guide, explains it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from dpcourse.harness.exercises import exercise_numbers, grading, numbering, registry
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

    p = sub.add_parser("grade", help="execute submitted notebooks and write a score table")
    p.add_argument("submissions", nargs="+", help="notebooks, or folders of them")
    p.add_argument("--out", default="scores.csv", help="the CSV file to write")
    p.add_argument(
        "--gradescope",
        metavar="DIR",
        help="also write a Gradescope results.json per notebook under DIR",
    )
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

    sub.add_parser("list", help="list the exercises that have checks, with their numbers")

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
    elif args.command == "grade":
        try:
            rows = grading.grade(
                [Path(s) for s in args.submissions], args.timeout, args.cell_timeout, args.jobs
            )
        except (ValueError, FileNotFoundError) as exc:
            parser.error(f"grade: {exc}")
        grading.write_csv(rows, Path(args.out))
        if args.gradescope:
            grading.write_gradescope(rows, Path(args.gradescope))
        if args.gradescope_file:
            target = Path(args.gradescope_file)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(grading.gradescope_results(rows), indent=1) + "\n")
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in rows:
            totals[r.submission][0] += r.score
            totals[r.submission][1] += 1
        for name, (score, count) in totals.items():
            print(f"{score}/{count}  {name}")
        print(f"scores written to {args.out}")
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
        for ex in registry().values():
            print(f"Exercise {ex.number or '?':<8} {ex.label:<22} "
                  f"check.{ex.name}({ex.function or '...'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
