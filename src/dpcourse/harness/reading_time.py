"""How long a chapter's main path takes to read, computed from the page (issue 45).

A chapter's opening says how long it takes to read. A guess went stale as the chapters grew (a
learner took 1.5 to 2.5 hours over chapters that said 45 and 55 minutes), so the figure is
computed from what the page shows, at a stated pace:

* **the main path**: the page from its title to its summary, without the deep dives (admonitions
  whose title starts with "Deep dive", folded on the website, and the code cells tagged
  ``deep-dive``), the worked problems, the exercises, the references, anything else folded (a
  dropdown, a ``hide-cell`` or ``hide-input`` cell) and the cells the website hides;
* **prose**: the words of its markdown (math and inline code count as words), at
  :data:`WORDS_PER_MINUTE`, a careful pace for technical text (studies of reading put skimming
  at 250 and more, study reading nearer 150);
* **code**: the lines of its code cells and of the listings they show (``show_source``), blank
  lines left out, and of the code blocks of its markdown, at :data:`CODE_LINES_PER_MINUTE`;
* rounded to the nearest 5 minutes.

The outputs (tables, figures, printed results) are not counted: reading them is part of the time
a learner spends running the notebook. ``python -m dpcourse.harness.reading_time --write`` writes
each chapter's figure into its opening ("Before you start"), from the executed notebooks in
``_build/executed`` (the listings are outputs), into the copies there too;
``tests/test_chapter_openings.py`` checks that the opening says what the page computes to, within
what its "about" allows (:func:`stale`: a sentence edited needs no new run, a section added does).

Chapter 0: the course's tooling (the chapters' openings).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CODE_LINES_PER_MINUTE", "WORDS_PER_MINUTE", "ReadingTime", "reading_time", "stale",
           "time_clause", "write_opening"]

WORDS_PER_MINUTE = 150
CODE_LINES_PER_MINUTE = 10
# Sections that are not the main path: their heading starts one, the next heading of the same
# level (or a higher one) ends it.
ASIDE_SECTIONS = re.compile(r"(?i)^(#+)\s+(?:[\d.]+\s+)?(worked problems|exercises|references)\b")
HIDDEN_TAGS = {"remove-cell", "remove-input", "hide-cell", "hide-input", "deep-dive", "solution"}
# The clause of the opening's "Time:" bullet that this module writes.
CLAUSE = re.compile(r"about \d+ minutes to read(?: the main path \([^)]*\))?")


@dataclass(frozen=True)
class ReadingTime:
    """Words and code lines on the main path and in the deep dives, and the minutes they take."""

    words: int
    code_lines: int
    deep_dive_words: int
    deep_dive_code_lines: int

    @property
    def minutes(self) -> int:
        """The main path's minutes at the stated pace, to the nearest 5 (at least 5)."""
        exact = self.words / WORDS_PER_MINUTE + self.code_lines / CODE_LINES_PER_MINUTE
        return max(5, 5 * round(exact / 5))

    @property
    def deep_dive_minutes(self) -> int:
        """The deep dives' reading time, to the nearest 5 minutes (0 where there are none)."""
        exact = (self.deep_dive_words / WORDS_PER_MINUTE
                 + self.deep_dive_code_lines / CODE_LINES_PER_MINUTE)
        return 5 * round(exact / 5) if exact >= 2.5 else (0 if exact == 0 else 5)


def _source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip())


def _words(text: str) -> int:
    return len(re.findall(r"[^\s|`*#>_-]+", text))


def _split_markdown(text: str) -> tuple[int, int, int, int]:
    """(words, code lines) of a markdown cell's main path, then of its deep dives. Fenced code
    blocks count as code; a dropdown (a deep dive, a solution, the code map) is not main path,
    and a deep dive's own words count as the deep dive's."""
    words = code = dive_words = dive_code = 0
    stack: list[tuple[str, str]] = []  # (fence, kind) kind: "code", "dive", "folded", "box"
    for line in text.splitlines():
        fence = re.match(r"\s*(`{3,}|~{3,}|:{3,})\s*(.*)$", line)
        if fence and stack and fence.group(1) == stack[-1][0] and not fence.group(2):
            stack.pop()
            continue
        kinds = {kind for _, kind in stack}
        if fence and "code" not in kinds:
            head = fence.group(2)
            if head.startswith("{") and not head.startswith(("{code", "{code-block")):
                kind = "dive" if re.search(r"(?i)deep dive", head) else (
                    "solution" if head.startswith(("{solution", "{exercise")) else "box")
            else:
                kind = "code"
            stack.append((fence.group(1), kind))
            if kind == "dive" and not ({"solution", "folded"} & kinds):  # its one-line summary
                words += _words(re.sub(r"^\{[\w-]+\}", "", head))
            continue
        if re.match(r"\s*:class:.*\bdropdown\b", line) and stack and stack[-1][1] == "box":
            stack[-1] = (stack[-1][0], "folded")
            continue
        if re.match(r"\s*:[\w-]+:", line):  # a directive's option
            continue
        kinds = {kind for _, kind in stack}
        in_code = "code" in kinds
        if "solution" in kinds or ("folded" in kinds and "dive" not in kinds):
            continue
        if "dive" in kinds:
            dive_code += bool(line.strip()) if in_code else 0
            dive_words += 0 if in_code else _words(line)
        elif in_code:
            code += bool(line.strip())
        else:
            words += _words(line)
    return words, code, dive_words, dive_code


def reading_time(notebook: dict, executed: dict | None = None) -> ReadingTime:
    """The reading time of a notebook's main path (see the module's docstring); the listings'
    lines are read from the outputs of the cells that call ``show_source``, in ``executed`` (the
    same notebook as it ran; its cell of the same id) or else in ``notebook`` itself."""
    ran = {cell.get("id"): cell for cell in (executed or notebook).get("cells", [])}
    words = code = dive_words = dive_code = 0
    aside_level = None  # the level of the aside section we are in, if any
    for cell in notebook.get("cells", []):
        text = _source(cell)
        if cell.get("cell_type") == "markdown":
            text = CLAUSE.sub("", text)  # the figure itself does not count (it would chase itself)
            kept = []
            for line in text.splitlines():
                heading = re.match(r"^(#+)\s", line)
                if heading:
                    level = len(heading.group(1))
                    if aside_level is not None and level <= aside_level:
                        aside_level = None
                    aside = ASIDE_SECTIONS.match(line)
                    if aside:
                        aside_level = len(aside.group(1))
                if aside_level is None:
                    kept.append(line)
            counts = _split_markdown("\n".join(kept))
            words, code = words + counts[0], code + counts[1]
            dive_words, dive_code = dive_words + counts[2], dive_code + counts[3]
            continue
        if cell.get("cell_type") != "code" or aside_level is not None:
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        lines = _lines(text)
        if "show_source(" in text:  # the listing it shows, from the run
            shown = ran.get(cell.get("id"), cell).get("outputs", [])
            lines += sum(_lines(_output_text(out)) for out in shown)
        if "deep-dive" in tags:
            dive_code += lines
        elif not HIDDEN_TAGS & tags and cell.get("id") != "install-dpcourse":
            code += lines
    return ReadingTime(words, code, dive_words, dive_code)


def _output_text(output: dict) -> str:
    text = (output.get("data") or {}).get("text/plain") or output.get("text") or ""
    return "".join(text) if isinstance(text, list) else text


def time_clause(time: ReadingTime) -> str:
    """The opening's words for it: "about 40 minutes to read the main path (...)"."""
    dives = (f"; the deep dives, folded, add about {time.deep_dive_minutes} minutes"
             if time.deep_dive_minutes else "")
    return (f"about {time.minutes} minutes to read the main path ({time.words:,} words at "
            f"{WORDS_PER_MINUTE} a minute and {time.code_lines} lines of code at "
            f"{CODE_LINES_PER_MINUTE} a minute{dives})")


def _set_first_cell(path: Path, notebook: dict, text: str) -> None:
    lines = text.split("\n")
    notebook["cells"][0]["source"] = [line + "\n" for line in lines[:-1]] + [lines[-1]]
    path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")


STATED = re.compile(r"about (?P<minutes>\d+) minutes to read the main path \((?P<words>[\d,]+) "
                    r"words at \d+ a minute and (?P<lines>[\d,]+) lines of code at \d+ a minute"
                    r"(?:; the deep dives, folded, add about (?P<dives>\d+) minutes)?\)")
# How far the opening's figures may be from the page's before they are stale: a rounding step of
# the minutes, a tenth of the words and of the lines. A sentence or a listing edited does not
# need a fresh run of every notebook; a section added or removed does.
MINUTES_SLACK, COUNT_SLACK = 5, 0.10


def stale(text: str, time: ReadingTime) -> str | None:
    """Why the opening ``text`` does not state ``time`` (what the page computes to) within what
    its "about" allows (:data:`MINUTES_SLACK`, :data:`COUNT_SLACK`); None where it does."""
    found = STATED.search(text)
    if not found:
        return "it states no reading time of the form 'about N minutes to read the main path (...)'"
    words, lines = (int(found.group(k).replace(",", "")) for k in ("words", "lines"))
    pairs = [("minutes", int(found.group("minutes")), time.minutes, MINUTES_SLACK),
             ("minutes of deep dives", int(found.group("dives") or 0), time.deep_dive_minutes,
              MINUTES_SLACK),
             ("words", words, time.words, COUNT_SLACK * time.words),
             ("lines of code", lines, time.code_lines, COUNT_SLACK * time.code_lines)]
    off = [f"{what}: it says {said:,}, the page computes to {real:,}"
           for what, said, real, slack in pairs if abs(said - real) > slack]
    return "; ".join(off) or None


def write_opening(source: Path, executed: Path) -> bool:
    """Write the reading time computed from ``executed`` into the opening of ``source`` (a
    chapter notebook saved without outputs); True where it changed. The executed copy's opening
    gets the same words where it had the same opening (a markdown cell: the run does not depend
    on it), so that the websites, rendered from the copies, need no second run."""
    notebook = json.loads(source.read_text())
    ran = json.loads(executed.read_text())
    text = _source(notebook["cells"][0])
    if not CLAUSE.search(text):
        raise ValueError(f"{source.name}: its opening has no 'about N minutes to read'")
    new = CLAUSE.sub(time_clause(reading_time(notebook, ran)), text, count=1)
    if new == text:
        return False
    _set_first_cell(source, notebook, new)
    if _source(ran["cells"][0]) == text:
        _set_first_cell(executed, ran, new)
    return True


def main(argv: list[str] | None = None) -> int:
    """Print (or, with --write, write into the openings) each chapter's reading time."""
    parser = argparse.ArgumentParser(prog="python -m dpcourse.harness.reading_time",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the book's folder")
    parser.add_argument("--executed", type=Path, default=None,
                        help="where make notebooks kept the executed copies "
                             "(default: ROOT/_build/executed)")
    parser.add_argument("--write", action="store_true", help="write the figures into the openings")
    args = parser.parse_args(argv)
    executed = args.executed or args.root / "_build" / "executed"
    for source in sorted((args.root / "chapters").glob("*.ipynb")):
        ran = executed / "chapters" / source.name
        if source.stem == "intro" or not ran.exists():
            continue
        time = reading_time(json.loads(source.read_text()), json.loads(ran.read_text()))
        changed = write_opening(source, ran) if args.write else False
        print(f"{source.stem}: {time_clause(time)}{' (written)' if changed else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
