"""Instructor commands: ``python -m dpcourse.exercises {student,grade,list}``."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from dpcourse.exercises import grading, registry
from dpcourse.exercises.student import make_student_edition


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.exercises", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("student", help="write the student edition of the book's sources")
    p.add_argument("--root", default=".", help="the book (folder with _config.yml)")
    p.add_argument("--out", default="_build/student", help="where to write it")

    p = sub.add_parser("grade", help="execute submitted notebooks and write a score table")
    p.add_argument("submissions", nargs="+", help="notebooks, or folders of them")
    p.add_argument("--out", default="scores.csv", help="the CSV file to write")
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

    sub.add_parser("list", help="list the exercises that have checks")
    args = parser.parse_args(argv)

    if args.command == "student":
        notebooks = make_student_edition(Path(args.root), Path(args.out))
        print(f"student edition written to {args.out} ({len(notebooks)} notebooks)")
        for nb in notebooks:
            print(f"  {nb}")
    elif args.command == "grade":
        rows = grading.grade([Path(s) for s in args.submissions], args.timeout, args.cell_timeout)
        grading.write_csv(rows, Path(args.out))
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for r in rows:
            totals[r.submission][0] += r.score
            totals[r.submission][1] += 1
        for name, (score, count) in totals.items():
            print(f"{score}/{count}  {name}")
        print(f"scores written to {args.out}")
    else:
        for ex in registry().values():
            print(f"{ex.label:<20} check.{ex.name}({ex.function or '...'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
