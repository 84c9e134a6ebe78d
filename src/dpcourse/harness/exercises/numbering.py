"""Exercise numbers: one scheme for the headings, the checks' messages and the text.

An exercise's label is ``ex-<part>-<slug>``: ``<part>`` is its chapter's number, or the short name
of an appendix page that has exercises (``lab``: diagnosing slow or hung training; ``bugs``: find
the bugs), so that no appendix takes a number a chapter may need. Its number is
``<part>.<k>``, ``k`` counting the page's exercises from 1 in the order the page shows them:
"Exercise 5.2" is chapter 5's second, "Exercise Lab.1" the lab's first. The website's headings
(``_ext/exercise_numbers.py``), each check's message
(:meth:`~dpcourse.harness.exercises.core.CheckResult.text`), the student edition's stubs, the
text's references (``{numref}`` to a label) and the instructor guide all use it.

The numbers of the book's exercises are kept in :mod:`dpcourse.harness.exercises.exercise_numbers`
(so that the package installed without the book still knows them), written from the pages by
``python -m dpcourse.harness.exercises numbers --write``; ``tests/test_exercise_numbers.py`` fails
when they differ from the pages, and the website's build warns (an error under -W).

Chapter 0: the exercise checks of the whole course.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dpcourse.harness.exercises import exercise_numbers

__all__ = [
    "APPENDICES",
    "parse_label",
    "part_title",
    "book_pages",
    "numbers_in_book",
    "number_of",
    "write_table",
]

# An appendix page with exercises: its part in the labels -> (the part as numbers show it, the
# page's file name without its suffix).
APPENDICES: dict[str, tuple[str, str]] = {
    "lab": ("Lab", "diagnosis_lab"),
    "bugs": ("Bugs", "bug_hunt"),
}
LABEL = re.compile(r"^ex-(?P<part>\d+|[a-z]+)-(?P<slug>[a-z0-9]+(?:-[a-z0-9]+)*)$")
# An {exercise} directive (backtick or colon fence) and the :label: among its options.
_EXERCISE = re.compile(
    r"^[ \t]*(?:`{3,}|:{3,})\{exercise\}[^\n]*\n"
    r"(?:[ \t]*:[\w-]+:[^\n]*\n)*?[ \t]*:label:[ \t]*(\S+)",
    re.M,
)
TABLE_MODULE = Path(__file__).with_name("exercise_numbers.py")


def parse_label(label: str) -> tuple[str, str]:
    """``(part, slug)`` of an exercise label: ``"ex-5-overlap"`` -> ``("5", "overlap")``.

    Raises ``ValueError`` saying what a label looks like for anything else."""
    m = LABEL.match(label) if isinstance(label, str) else None
    if not m or not (m["part"].isdigit() or m["part"] in APPENDICES):
        raise ValueError(
            f"exercise labels look like 'ex-<chapter>-<slug>' (ex-5-overlap) or, on an appendix "
            f"page, 'ex-<{'|'.join(APPENDICES)}>-<slug>', the slug in lower-case words joined "
            f"by '-'; got {label!r}"
        )
    return m["part"], m["slug"]


def part_title(part: str) -> str:
    """How numbers show a part: ``"5"`` -> ``"5"``, ``"lab"`` -> ``"Lab"``."""
    return part if part.isdigit() else APPENDICES[part][0]


def _page_part(path: Path | str) -> str | None:
    """The part whose exercises a page holds, from its file name (``05_collectives`` -> ``"5"``,
    ``diagnosis_lab`` -> ``"lab"``), or None for a page that is neither."""
    stem = Path(path).stem
    m = re.match(r"(\d+)_", stem)
    if m:
        return str(int(m.group(1)))
    return next((part for part, (_, page) in APPENDICES.items() if page == stem), None)


def _labels_in_text(text: str) -> list[str]:
    """The labels of the ``{exercise}`` directives in a page's markdown, in order."""
    return _EXERCISE.findall(text)


def _markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n".join(
            "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells
            if c["cell_type"] == "markdown"
        )
    return path.read_text()


def book_pages(root: Path | str) -> list[Path]:
    """The pages of the book at ``root`` in the order of its ``_toc.yml``."""
    # import here: optional (pyyaml is not one of the package's needs): only the instructor's
    # tools read _toc.yml, and a learner's notebook imports this module through the checks
    import yaml  # noqa: PLC0415

    root = Path(root)
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    files = [toc["root"]] + [
        entry["file"] for part in toc.get("parts", []) for entry in part.get("chapters", [])
    ]
    pages = []
    for name in files:
        found = [root / f"{name}{suffix}" for suffix in (".ipynb", ".md")]
        pages += [p for p in found if p.exists()][:1]
    return pages


def numbers_in_book(root: Path | str) -> dict[str, str]:
    """Every exercise of the book at ``root`` and its number, from the pages themselves.

    Raises ``ValueError`` for a label that is malformed, used twice, or whose part is not its
    page's (an ``ex-7-...`` exercise in chapter 5, an ``ex-11-...`` one in the lab)."""
    numbers: dict[str, str] = {}
    for path in book_pages(root):
        for k, label in enumerate(_labels_in_text(_markdown_of(path)), start=1):
            part, _ = parse_label(label)
            if part != _page_part(path):
                raise ValueError(
                    f"{path.name}: the exercise {label!r} is labelled for part {part!r}, but the "
                    f"page's exercises are labelled ex-{_page_part(path) or '?'}-<slug>"
                )
            if label in numbers:
                raise ValueError(f"{path.name}: the label {label!r} is used twice")
            numbers[label] = f"{part_title(part)}.{k}"
    return numbers


def number_of(label: str) -> str | None:
    """The number of the book's exercise ``label`` ("5.2", "Lab.1"), or None if the book has
    no exercise of that label."""
    return exercise_numbers.NUMBERS.get(label)


def _table_source(numbers: dict[str, str]) -> str:
    """The source of ``exercise_numbers.py`` for ``numbers``."""
    rows = "".join(f"    {label!r}: {number!r},\n" for label, number in numbers.items())
    return (
        '"""The number of every exercise of the book, by label, in the book\'s order.\n\n'
        "Generated from the pages by ``python -m dpcourse.harness.exercises numbers --write``: "
        "do not edit;\n:mod:`dpcourse.harness.exercises.numbering` explains the scheme.\n\n"
        'Chapter 0: the exercise checks of the whole course.\n"""\n\n'
        "NUMBERS: dict[str, str] = {\n" + rows + "}\n"
    )


def write_table(root: Path | str) -> bool:
    """Write ``exercise_numbers.py`` from the book at ``root``; True if it changed."""
    new = _table_source(numbers_in_book(root))
    old = TABLE_MODULE.read_text() if TABLE_MODULE.exists() else ""
    if new != old:
        TABLE_MODULE.write_text(new)
    return new != old
