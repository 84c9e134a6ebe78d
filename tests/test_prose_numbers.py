"""The numbers in the book's text agree with the run that printed them (issue 34).

A sentence such as "overlap saved 8 to 12 ms" next to an output that says "overlap saves
13.4 ms" contradicts its own page. Every number that depends on the run comes into the text from
the run, with myst-nb's glue (``dpcourse.harness.prose.glue`` in a cell, ``{glue:text}`key` ``
in the markdown); every other number is one that holds on every run (a published figure, an
assumption stated as one, an input of the cell, the arithmetic of a model, a recorded run named
as such) and is listed below, page by page, with the reason it holds.

* From the sources (always, a second or so): every quantity a markdown cell quotes (a time, a
  rate, a percentage, a ratio, a decimal) is either glued or listed in :data:`STATED` for its
  page, and every listed one still occurs there (so the list cannot go stale); every key the
  text quotes is glued by a cell that both editions keep (not a solution cell, whose outputs the
  student edition drops).
* From the executed notebooks (``_build/executed``, which ``make notebooks`` writes before the
  tests run; ``DPCOURSE_EXECUTED`` names another folder): every key the text quotes was glued in
  that run, and every number of :data:`PRINTED` (a model's arithmetic that the text repeats) is
  what the run printed.

A new number in the text fails the first test until it is glued or listed with its reason.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from pathlib import Path

import pytest

from dpcourse.harness import prose, reading_time

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ROOT / "chapters"
PAGES = sorted(CHAPTERS.glob("*.ipynb"))
EXECUTED = Path(os.environ.get("DPCOURSE_EXECUTED") or ROOT / "_build" / "executed") / "chapters"

# A quantity: a number or a range of two ("8 to 12 ms", "0.8 and 3.5 ms", "48-52 ms") with a
# unit of time, rate, share or ratio. Byte sizes are left out: in the text they are the inputs
# of the cells (1 MiB, 25 MiB buckets), not what a run measures.
NUMBER = r"[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
UNIT = (
    r"%|ns\b|us\b|µs\b|ms\b|s\b|seconds?\b|minutes?\b|min\b|hours?\b"
    r"|[KMGT]B/s\b|[KMGT]bit/s\b|[KMGT]b/s\b|[KMGTP]?FLOP/s\b|samples/s\b|samples per second\b"
    r"|x\b(?!\s*\d)|×(?!\s*\d)|times\b|-fold\b"
)
QUANTITY = re.compile(
    rf"(?<![\w.]){NUMBER}(?:\s*(?:to|-|–|and|or)\s*{NUMBER})?\s*(?:{UNIT})"
)
# A decimal without a unit (a loss, a learning rate, a factor): not a version number
# (torch 2.13.0), not an arXiv identifier (1706.03762).
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.]*\d)(?![A-Za-z])")
# A number in scientific notation (a difference of 7.8e-4, a tolerance of 1e-5).
SCIENTIFIC = re.compile(r"(?<![\w.])\d+(?:\.\d+)?e[-+−]?\d+\b")
ARXIV = re.compile(r"\b\d{4}\.\d{4,5}\b")
VERSION = re.compile(
    r"(?i)\b(?:torch|pytorch|nccl|python|cuda|capability|version|v)\s+\(?\d+(?:\.\d+)+"
)
# What the text refers to by number: sections, chapters, problems, exercises.
REFERENCE = re.compile(
    r"(?i)\b(?:sections?|chapters?|problems?|tables?|figures?|issues?|exercises?|steps?|"
    r"equations?|appendix|part)\s+\d+(?:\.\d+)*(?:\s*(?:and|to|-|,)\s*\d+(?:\.\d+)*)*"
)
GLUE_ROLE = re.compile(r"\{glue(?::\w*)?\}`([^`]*)`")
# prose.glue("key", ...) or prose.glue(f"{name}_key", ...): an f-string names a family of keys.
GLUE_CALL = re.compile(r"\bglue\(\s*(?P<f>f?)(?P<q>[\"'])(?P<key>[^\"']+)(?P=q)")


def drop_code_blocks(markdown: str) -> str:
    """The markdown without the contents of its code blocks (a fence with no directive, or a
    ``{code-block}``/``{code-cell}``); a directive's contents (an exercise, an admonition) stay."""
    kept, open_fences = [], []  # [(fence, is a code block)], innermost last
    for line in markdown.splitlines():
        fence = re.match(r"\s*(`{3,}|~{3,}|:{3,})\s*(.*)$", line)
        inside_code = bool(open_fences) and open_fences[-1][1]
        if fence and open_fences and fence.group(1) == open_fences[-1][0] and not fence.group(2):
            open_fences.pop()  # a closing fence
        elif inside_code:
            pass
        elif fence:
            directive = fence.group(2).startswith("{") and not fence.group(2).startswith("{code")
            open_fences.append((fence.group(1), not directive))
            kept.append(line)
        else:
            kept.append(line)
        # (the lines of a code block are dropped; a directive's lines are kept)
    return "\n".join(kept)


def prose_of(markdown: str) -> str:
    """The sentences of a markdown cell: without code, math, links' targets, headings, directive
    options, roles and what glue pastes in (that comes from the run)."""
    gap = " § "  # what stands for a removed span, so that "rank 1 `continue`s" reads no "1 s"
    text = GLUE_ROLE.sub(gap, drop_code_blocks(markdown))
    # the opening's reading time: computed from the page, checked by test_chapter_openings.py
    text = reading_time.CLAUSE.sub(gap, text)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", gap, text)  # {doc}, {term}, {cite:p}...
    text = re.sub(r"^\s*(?:`{3,}|:{3,}).*$", " ", text, flags=re.M)  # fences, directive lines
    text = re.sub(r"^\s*:[\w-]+:.*$", " ", text, flags=re.M)  # directive options
    text = re.sub(r"`[^`\n]*`", gap, text)
    text = re.sub(r"\$\$.*?\$\$", gap, text, flags=re.S)
    text = re.sub(r"\$[^$\n]*\$", gap, text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<https?://[^>\s]*>|https?://\S+", " ", text)
    text = re.sub(r"^\s*#+ .*$", " ", text, flags=re.M)
    text = re.sub(r"^\s*\(.*\)=\s*$", " ", text, flags=re.M)  # targets
    for pattern in (REFERENCE, VERSION, ARXIV):
        text = pattern.sub(" ", text)
    return text


def quantities(markdown: str) -> list[str]:
    """The quantities a markdown cell quotes outside glue, as written (spaces normalised)."""
    text = prose_of(markdown)
    found = [m.group(0) for m in QUANTITY.finditer(text)]
    rest = QUANTITY.sub(" ", text)
    found += [m.group(0) for m in SCIENTIFIC.finditer(rest)]
    found += [m.group(0) for m in DECIMAL.finditer(SCIENTIFIC.sub(" ", rest))]
    return [re.sub(r"\s+", " ", q) for q in found]


def cells(nb: dict, kind: str) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == kind]


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def quoted_keys(nb: dict) -> list[str]:
    """The glue keys the text quotes (a role's ``key:format`` gives ``key``)."""
    keys = []
    for cell in cells(nb, "markdown"):
        for content in GLUE_ROLE.findall(source(cell)):
            keys.append(content.split("::")[-1].rsplit(":", 1)[0] if ":" in content else content)
    return keys


def is_solution(cell: dict) -> bool:
    tags = cell.get("metadata", {}).get("tags", [])
    return "solution" in tags or "BEGIN SOLUTION" in source(cell)


def key_pattern(match: re.Match) -> str:
    """A glued key as a regular expression: an f-string's fields match any name."""
    key = match.group("key")
    if not match.group("f"):
        return re.escape(key)
    return "".join(
        r"[\w.-]+" if part.startswith("{") else re.escape(part)
        for part in re.split(r"(\{[^}]*\})", key)
    )


def glued_in_source(nb: dict) -> tuple[set[str], set[str]]:
    """(patterns of the keys glued by cells both editions keep, those glued only in solution
    cells)."""
    kept, solution = set(), set()
    for cell in cells(nb, "code"):
        keys = {key_pattern(m) for m in GLUE_CALL.finditer(source(cell))}
        (solution if is_solution(cell) else kept).update(keys)
    return kept, solution - kept


def not_glued(keys: list[str], patterns: set[str]) -> list[str]:
    return sorted({k for k in keys if not any(re.fullmatch(p, k) for p in patterns)})


def unaccounted(nb: dict, stated: set[str]) -> list[str]:
    """Quantities in the text that are neither glued nor stated as holding on every run."""
    return [q for c in cells(nb, "markdown") for q in quantities(source(c)) if q not in stated]


def printed_text(nb: dict) -> str:
    """Everything the code cells of an executed notebook printed or displayed as text."""
    parts = []
    for cell in cells(nb, "code"):
        for out in cell.get("outputs", []):
            text = out.get("text") or (out.get("data") or {}).get("text/plain") or ""
            parts.append("".join(text) if isinstance(text, list) else text)
    return re.sub(r"\s+", " ", "\n".join(parts))


# Page by page, the quantities the text quotes that hold on every run, by the reason they do.
# A reason's quantities are separated by " | ", each exactly as quantities() reads it.
TIME = ("the running time of the page, estimated once (the opening's box; its reading time is "
        "computed, and checked by tests/test_chapter_openings.py)")
RECORDED = "a recorded run, named as such in the sentence, with its file in benchmarks/"
HARDWARE = "a vendor's figure or a stated assumption (dpcourse.cost.hardware)"
MODEL = "the arithmetic of a model on fixed inputs, the same on every run"
INPUT = "an input of the cells or a setting of the code (a size, a rate, a timeout)"
FACT = "a fact of the tools or of the maths"
PUBLISHED = "a figure a cited paper or report publishes"
SECTION = "a section of the chapter, named by its number"
STATED: dict[str, dict[str, str]] = {
    "01_single_device": {
        MODEL: "200 times | 1.6 | 7.5 | 3%",
    },
    "02_data_parallel_idea": {MODEL: "4.2"},
    "04_naive_averaging": {
        INPUT: "10 and 40 % | 0.1 | 0.9",
        MODEL: "8 times | 0.8 | 0.0125",
    },
    "05_collectives": {
        HARDWARE: "450 GB/s | 400 Gbit/s | 50 GB/s | 3 µs | 5 µs",
        INPUT: "5 seconds | 5 s",
        MODEL: "35 s | 15 s",
        FACT: "10 minutes",
    },
    "06_ring_all_reduce": {
        TIME: "2 minutes | 15-20 s",
        RECORDED: "1.1 to 2.1 times | 3 ms | 3.3 ms | 0.8 and 3.5 ms | 1 ms | 0.91 ms | 2.60 ms"
        " | 0.81 and 2.49 ms | 3.65 ms | 1.50 ms | 1.13 ms | 6.02 ms | 0.95 and 1.30 ms | 0.43 ms"
        " | 7 % | 3.8 times | 10 % | 40 % | 22 % | 44 % | 37 % | 17 % | 155 us | 205 us"
        " | 2,032 us | 6.7 to 7.3 times | 65 to 97 % | 5 to 10 %",
        HARDWARE: "5 us | 12.5 GB/s | 100 Gb/s | 450 GB/s | 400 Gbit/s | 50 GB/s | 3 µs | 5 µs",
        MODEL: "4 times | 16 ms | 7 times | 3 times | 1.75 | 1.998 | 1.5",
        INPUT: "1.5 ms | 1 Gbit/s | 20 % | 25 % | 30 s",
        FACT: "4 ms | 4 %",
    },
    "07_ddp": {
        TIME: "2 minutes | 10 s",
        RECORDED: "48 to 52 ms | 8 to 12 ms | 17 to 20 ms | -4.6 to -1.0 ms | 6 to 9 ms"
        " | -5 to +16 ms",
        HARDWARE: "989 TFLOP/s | 40 % | 400 Gbit/s | 50 GB/s | 5 µs",
        MODEL: "6 times | 12.5 MB/s | 55 ms | 80 ms | 0.66",
        INPUT: "100 Mbit/s | 0.1 | 0.25 | 1 %",
    },
    "08_training_at_scale": {
        TIME: "3 minutes",
        INPUT: "0.9 | 0.02 | 120 s | 600 s | 1 Gbit/s | 1e-6 | 30 minutes | 2 GB/s"
        # section 8.6: the collective timeouts (2 s, in gloo's words 2000ms; 5 s in the elastic
        # runs; the runtime's default of 5 minutes), the stand-in compute, the links' rates, the
        # heartbeats, the cut's length and the agents' --max-restarts
        " | 2 s | 2000ms | 5 s | 5 minutes | 20 ms | 100 Mbit/s | 1 s | 8 s | 3 times",
        RECORDED: "28.5 s",
        # the trainer's --lr of 3e-3 scaled by the linear rule to 2 ranks, then to 1
        MODEL: "8 times | 0.64 | 6e-3 | 3e-3",
        PUBLISHED: "0.1",
        HARDWARE: "400 Gbit/s | 50 GB/s",
        # section 8.6 too: InfiniBand's timeout unit and NCCL's default NCCL_IB_TIMEOUT (20)
        # in it, read from NCCL's sources
        FACT: "7.5 | 10 minutes | 3e-8 | 6e-8 | 4.096 µs | 4.3 s",
    },
    "09_sharded_optimizers": {
        RECORDED: "7.8e-4 | 4e-6 | 1.1e-4 | 0.93 times | 0.86 | 2-3 %",
        HARDWARE: "989 TFLOP/s | 40 % | 50 GB/s | 400 GB/s | 5 µs",
        MODEL: "1.5 times | 1.5 | 13.04",
        INPUT: "7.5 | 0.5 | 4 times | 1e-5 | 2 %",
        FACT: "1e-8 | 1e-10",
        SECTION: "9.4 | 9.5 | 9.6 | 9.8 | 9.9 | 9.11",
    },
    "10_scaling": {
        RECORDED: "1.3 to 1.45 times | 10 %",
        HARDWARE: "989 TFLOP/s | 312 TFLOP/s | 40 % | 900 GB/s | 450 GB/s | 400 Gb/s | 50 GB/s"
        " | 3 us | 5 us | 400 GB/s | 200 Gbit/s | 25 GB/s | 0.4",
        PUBLISHED: "46 % | 57.8 % | 52 %",
        MODEL: "9x | 8 times | 1.5x | 4x | 4.2 | 1.2 | 2.6 | 0.65 s | 0.1 s | 0.43 s | 0.07 s"
        " | 0.4 s | 100-fold | 0.9",
        INPUT: "1.3 | 90 % | 80 % | 400 Mbit/s | 0.05 | 0.025 | 0.8",
    },
    "11_sharding_at_scale": {
        RECORDED: "0.3 % | 259 times | 20 % | 32.6 | 0.6 | 16.0 | 32.0 | 123 ms | 154 and 223 ms"
        " | 136 and 206 ms | 60 and 100 ms",
        HARDWARE: "989 TFLOP/s | 450 GB/s | 50 GB/s | 3 and 5 µs | 5 µs | 400 GB/s",
        MODEL: "0.41 s | 0.15 s | 0.015 s | 0.61 s | 0.51 s | 0.76 | 0.47 | 0.87 | 0.41 | 1.00"
        " | 1.51 | 2.26 | 5.4 | 76.8 | 102.4",
        INPUT: "0.2 ms | 8.4 | 0.02 | 100 Mbit/s | 400 Mbit/s | 4 Gbit/s | 1.2",
    },
    "12_communicating_less": {
        # the emulated links, the budgets of problems 12.1 and 12.1's links, the 1.3 billion
        # parameters, torch's min_compression_rate
        INPUT: "10 Mbit/s | 100 Mbit/s | 1 Gbit/s | 10 % | 5 % | 10 Gbit/s | 1.3"
        " | 2 times",
        HARDWARE: "989 TFLOP/s | 40 %",
        # DiLoCo's outer learning rate and its 500 steps between synchronisations
        PUBLISHED: "0.7 | 500 times",
        FACT: "2.10",  # NCCL's first version that sums bf16
    },
    "diagnosis_lab": {
        RECORDED: "8.7 to 9.8 ms | 0.13 to 0.14 ms | 0.47 ms | 16.7 to 20.5 ms | 0.24 to 0.39 ms"
        " | 214 ms | 0.039 ms | 52.0 to 52.6 ms",
        PUBLISHED: "460 to 480 GB/s",
        HARDWARE: "450 GB/s",
        INPUT: "40 ms | 3 seconds | 5 minutes | 50 ms",
        MODEL: "1.5 times | 0.931 times",
        FACT: "1.074 | 100 Gb/s | 12.5 GB/s | 10 minutes",
    },
    "bug_hunt": {
        MODEL: "0.0007 | 0.088 | 0.0088",
        INPUT: "0.1",
    },
}

# Numbers the text repeats from a model's arithmetic (fixed inputs, so the same on every run)
# that the run also prints: the test checks that the run printed exactly these.
PRINTED: dict[str, list[str]] = {
    "05_collectives": ["35 s", "15 s"],
    "07_ddp": ["55 ms", "0.66"],
    "10_scaling": ["0.65 s", "2.6"],
    "11_sharding_at_scale": ["0.41 s", "0.015 s", "0.51 s", "0.76", "0.47", "0.87", "0.41", "5.4",
                             "1.00", "1.51", "2.26"],
}


def stated(page: str) -> set[str]:
    return {q.strip() for reason in STATED.get(page, {}).values() for q in reason.split(" | ")}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_every_quantity_in_the_text_is_glued_or_holds_on_every_run(path):
    nb = load(path)
    missing = unaccounted(nb, stated(path.stem))
    assert not missing, (
        f"{path.name}: the text quotes {sorted(set(missing))}, which are neither glued from the "
        "run ({glue:text}`key` with dpcourse.harness.prose.glue in a cell) nor listed in "
        "tests/test_prose_numbers.py's STATED with the reason they hold on every run"
    )
    in_text = {q for c in cells(nb, "markdown") for q in quantities(source(c))}
    stale = sorted(stated(path.stem) - in_text)
    assert not stale, f"{path.name}: STATED lists {stale}, which its text no longer quotes"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_every_key_the_text_quotes_is_glued_by_a_cell_both_editions_keep(path):
    nb = load(path)
    kept, only_in_solutions = glued_in_source(nb)
    missing = not_glued(quoted_keys(nb), kept)
    in_solutions = [k for k in missing if not not_glued([k], only_in_solutions)]
    assert not missing, (
        f"{path.name}: the text quotes glue keys {missing} that no cell glues"
        + (
            f"; {in_solutions} only in solution cells, whose outputs the student edition drops"
            if in_solutions
            else ""
        )
    )


def cell_sources(nb: dict) -> list[tuple[str, str]]:
    return [(c["cell_type"], source(c)) for c in nb["cells"]]


def executed_copy(path: Path) -> Path:
    """The executed copy of ``path``: skipped where there is none or it ran an older version of
    the page (an error under ``DPCOURSE_REQUIRE_SITE``, as in ``make test``, which runs every
    notebook first)."""
    copy = EXECUTED / path.name
    problem = None
    if not copy.exists():
        problem = f"no executed copy of {path.name} in {EXECUTED}"
    elif cell_sources(load(copy)) != cell_sources(load(path)):
        problem = f"{copy} ran an older version of {path.name}"
    if problem:
        if os.environ.get("DPCOURSE_REQUIRE_SITE"):
            raise AssertionError(f"{problem}: `make notebooks` did not run the current page")
        pytest.skip(f"{problem}: run `make notebooks`")
    return copy


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_the_run_glued_every_key_the_text_quotes(path):
    nb = load(executed_copy(path))
    missing = sorted(set(quoted_keys(load(path))) - set(prose.glued(nb)))
    assert not missing, f"{path.name}: the run glued no value for {missing}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_the_models_numbers_the_text_repeats_are_what_the_run_printed(path):
    printed = printed_text(load(executed_copy(path)))
    differ = [q for q in PRINTED.get(path.stem, []) if q not in printed]
    assert not differ, f"{path.name}: the text says {differ}, which the run did not print"


def test_every_page_is_listed_under_its_own_name():
    names = {p.stem for p in PAGES}
    assert set(STATED) <= names and set(PRINTED) <= names, set(STATED) | set(PRINTED) - names
    for page, numbers in PRINTED.items():
        assert set(numbers) <= stated(page), f"{page}: PRINTED numbers must be in STATED too"


# The checkers, shown failing on made-up pages, so that none of the tests above passes by
# seeing nothing.


def made_up(markdown: str, code: str = "", outputs: list | None = None) -> dict:
    return {
        "cells": [
            {"cell_type": "code", "source": code, "metadata": {}, "outputs": outputs or []},
            {"cell_type": "markdown", "source": markdown, "metadata": {}},
        ]
    }


def test_quantities_are_read_as_a_reader_reads_them():
    text = (
        "Overlap saved 8 to 12 ms (section 7.8), -4.6 to -1.0 ms with one bucket; the tree was "
        "+44 % off, alpha 61 us, the ring 3.8 times faster at 950 Mbit/s, a loss of 2.65, "
        "7.8e-4 apart. "
        "Not these: `13.4 ms`, $0.5 s$, torch 2.13.0, arXiv 1706.03762, a 840 x 312 tensor, "
        "{glue:text}`saved` ms, chapter 6.4, [link](../x/1.5ms.html), rank 1 `continue`s."
    )
    assert quantities(text) == [
        "8 to 12 ms", "-4.6 to -1.0 ms", "+44 %", "61 us", "3.8 times", "950 Mbit/s", "7.8e-4",
        "2.65",
    ]


def test_a_number_that_is_neither_glued_nor_stated_is_reported():
    nb = made_up("Overlap saved 8 to 12 ms; the run printed {glue:text}`saved`.")
    assert unaccounted(nb, set()) == ["8 to 12 ms"]
    assert unaccounted(nb, {"8 to 12 ms"}) == []


def test_a_key_glued_only_in_a_solution_cell_or_nowhere_is_reported():
    nb = made_up("It saved {glue:text}`saved:.1f` ms and {glue:text}`other`.",
                 "# BEGIN SOLUTION\nprose.glue('saved', 13.4)\n# END SOLUTION")
    assert quoted_keys(nb) == ["saved", "other"]
    kept, only_in_solutions = glued_in_source(nb)
    assert kept == set() and only_in_solutions == {"saved"}
    assert not_glued(quoted_keys(nb), kept) == ["other", "saved"]
    family = made_up("{glue:text}`ring_smallest` and {glue:text}`tree_largest`",
                     'for name in names:\n    prose.glue(f"{name}_smallest", t)')
    assert not_glued(quoted_keys(family), glued_in_source(family)[0]) == ["tree_largest"]


def test_a_key_the_run_did_not_glue_and_a_printed_number_that_differs_are_found():
    record = {
        "output_type": "display_data",
        "data": {prose.GLUE_PREFIX + "text/plain": "'13.4 ms'"},
        "metadata": {"scrapbook": {"name": "saved", "mime_prefix": prose.GLUE_PREFIX}},
    }
    printed = {"output_type": "stream", "name": "stdout", "text": "the naive one: 163.690 s\n"}
    nb = made_up("", outputs=[record, printed])
    assert prose.glued(nb) == {"saved": "13.4 ms"}
    assert "164 s" not in printed_text(nb) and "163.690 s" in printed_text(nb)


def test_an_executed_copy_of_an_older_page_is_skipped_or_fails_under_make_test(
    tmp_path, monkeypatch
):
    page, ran = tmp_path / "page.ipynb", tmp_path / "executed" / "page.ipynb"
    ran.parent.mkdir()
    page.write_text(json.dumps(made_up("Saved {glue:text}`saved`.")))
    ran.write_text(json.dumps(made_up("Saved 8 to 12 ms.")))
    monkeypatch.setattr(sys.modules[__name__], "EXECUTED", ran.parent)
    monkeypatch.delenv("DPCOURSE_REQUIRE_SITE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="older version"):
        executed_copy(page)
    monkeypatch.setenv("DPCOURSE_REQUIRE_SITE", "1")
    with pytest.raises(AssertionError, match="older version"):
        executed_copy(page)
    ran.write_text(page.read_text())
    assert executed_copy(page) == ran


# --- Issue 45: sentences that compare or judge what the run measured ---------------------------
# "Overlap saved little", "only the last bucket is left after backward", "ours is a few MiB
# above": a sentence beside a measurement that compares or judges it must hold on every build.
# Its words come from the run (a glue role in the sentence), or a cell checks it with
# prose.holds(claim, ...), whose claim is words of the sentence (hidden on the website), or it is
# listed below with the reason it holds whatever the run measures. "Beside a measurement": in
# the markdown that follows a code cell whose output varies from run to run (tagged
# nbval-ignore-output; cells the website hides are skipped), up to the next heading.
COMPARES = re.compile(
    r"(?i)\b(?:faster|slower|quicker|sooner|more than|less than|fewer|higher|lower|above|below|"
    r"larger|smaller|bigger|longer|shorter|saves?|saved|costs?|cheaper|wins?|won|beats?|ahead|"
    r"behind|overtak\w*|outperform\w*|usually|dominat\w*|slows?|speeds? up|speed-up|grows?|grew|"
    r"falls?|fell|drops?|rises?|rose|flat|matches|agrees?|exceeds?|close to|barely|twice|half|"
    r"only|about as|about the same|no faster|no slower|as fast as|as long as|little)\b"
)
HIDDEN = {"remove-cell", "remove-input"}
RUN_WORDS = " ‹run› "  # what stands for a glue role in a sentence


def sentences(markdown: str) -> list[str]:
    """The sentences of a markdown cell as a reader reads them (see prose_of), a glue role
    standing as ‹run›, tables left out; a list item ends a sentence too."""
    text = prose_of(GLUE_ROLE.sub(RUN_WORDS, markdown))
    text = re.sub(r"^\s*\|.*$", " ", text, flags=re.M)  # tables: reference, not the run's
    parts = re.split(r"(?<=[.!?:;])\s+(?=[A-Z(*‹])|\n\s*(?:[*|-]|\d+\.)\s|\n\s*\n", text)
    return [" ".join(p.split()) for p in parts if p.strip()]


def beside_a_measurement(nb: dict) -> list[tuple[int, str]]:
    """(cell index, sentence) for every sentence that compares, in the markdown beside a
    measurement: after a code cell tagged nbval-ignore-output (its output varies from run to
    run; hidden cells skipped), up to the next heading."""
    found, beside = [], False
    for i, cell in enumerate(nb["cells"]):
        tags = set(cell["metadata"].get("tags", []))
        if cell["cell_type"] == "code":
            if not HIDDEN & tags and "nbval-ignore-output" in tags:
                beside = True
            continue
        if not beside:
            continue
        text = source(cell)
        heading = re.search(r"^#+ ", text, re.M)
        if heading:
            text, beside = text[: heading.start()], False
        found += [(i, s) for s in sentences(text) if COMPARES.search(s)]
    return found


def checked_claims(nb: dict) -> list[str]:
    """The claims the page's cells check with prose.holds (its first argument, a string)."""
    claims = []
    for cell in cells(nb, "code"):
        try:
            tree = ast.parse(source(cell))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", None)) == "holds" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                claims.append(" ".join(str(node.args[0].value).split()))
    return claims


def unguarded(nb: dict, general: list[str]) -> list[str]:
    """The comparing sentences beside a measurement that are neither worded by the run, nor
    checked by a cell, nor listed as holding on every run (by their first words)."""
    claims = checked_claims(nb)
    return [s for _, s in beside_a_measurement(nb)
            if RUN_WORDS.strip() not in s and not any(c in s for c in claims)
            and not any(s.startswith(g) for g in general)]


def general(page: str) -> list[str]:
    return [g.strip() for reason in GENERAL.get(page, {}).values() for g in reason.split(" | ")]


ASSERTED = "a visible assert of the cell beside it checks it on every run"
MECHANISM = "says how the mechanism works, or what to expect on other machines, not what ran"
SAME_EVERY_RUN = "about what the run computes the same every time (seeded, counted, modelled)"
RECORDED_RUN = "about a recorded run, named as such"
GENERAL: dict[str, dict[str, str]] = {
    "01_single_device": {
        ASSERTED: "The loss of each step is noisy",
        MECHANISM: "A translation counts as right only | While the curve rises with a slope of one"
        " | One device reaches a maximum | To go faster we need more devices",
    },
    "02_data_parallel_idea": {
        ASSERTED: "The right-hand panel shows the part",
        MECHANISM: "(PyTorch releases the GIL | Where the machine has at least two GPUs"
        " | The rest of the course removes them",
    },
    "03_manual_replication": {MECHANISM: "On GPUs each of those copies crosses a bus"},
    "04_naive_averaging": {ASSERTED: "The bytes are exactly"},
    "06_ring_all_reduce": {
        RECORDED_RUN: "On 2 ranks the library is usually ahead"
        " | In the runs recorded on the course's 2-core | **The 3 ms that medians add"
        " | With a core per rank the waits go"
        " | In the runs recorded in the repository | With larger messages and a core per rank",
        MECHANISM: "The ring above posts each message | With a core to spare | The cell below times"
        " 60 calls | A call counts as stalled | A kilobyte is no work | The library's all-reduce is"
        " a ring | The naive all-reduce keeps only | Medians also hide | The next section puts"
        " numbers | NCCL cuts the message",
        SAME_EVERY_RUN: "Below is **modelled, not measured** | The ring's time levels off",
    },
    "07_ddp": {
        ASSERTED: "The TinyTransformer's gradients are under a mebibyte | The cell asserts only",
        RECORDED_RUN: "In the three runs recorded | In the course's CI",
        MECHANISM: "Whether overlap *saves time* depends | On a GPU, NCCL's collectives"
        " | The mechanism is the same | On a slower CPU | On a busy machine it hides less"
        " | The variants take turns | On a busy machine other programs blur"
        " | So it is a drop-in replacement",
    },
    "08_training_at_scale": {
        MECHANISM: "On a CPU, | CPUs have little float16 arithmetic) | On NVIDIA GPUs float16"
        " | Ampere and later GPUs | Unscale first | What ends it is the process group's"
        " | Here is that, in a terminal command | The trainer now keeps each attempt's keys"
        " | Inside any of them | The run must end with the weights",
        SAME_EVERY_RUN: "With the wrong order rank 0 stepped",
    },
    "09_sharded_optimizers": {
        MECHANISM: "On this CPU machine all four share | Without prefetch (bottom) the"
        " communication | On a GPU the times above are read | Who holds what, drawn from those"
        " counts",
        RECORDED_RUN: "The matmuls are on the compute stream only | With ranks sharing one GPU",
        SAME_EVERY_RUN: "Stage 3's shards are whole rows | One difference is ours",
    },
    "10_scaling": {
        RECORDED_RUN: "In the runs recorded on the course's 2-core machine",
        MECHANISM: "On GPUs each rank has its own device | * Whether weak or strong scaling"
        " | Where it is above, it is because"
        " | Where the measured speed-up stays below | With k GPUs per node | A flat all-reduce"
        " that runs k rings | McCandlish et al. find | Once it is well past | Beyond that the"
        " options",
    },
    "11_sharding_at_scale": {
        ASSERTED: "The bytes agree with the formula",
        RECORDED_RUN: "Memory needs a model whose parameters | The gathered bf16 layers also take"
        " | The recorded run gives 4 ranks | On faster links the wire's share | FSDP and HSDP send"
        " many more messages | HSDP, with fewer ring steps | HSDP ahead of FSDP on slow links",
        MECHANISM: "What a bf16 reduction costs | While the ranks' gradients agree"
        " | With a card per GPU, FSDP's flat ring | On real hardware NVLink's latency",
        SAME_EVERY_RUN: "Summed first, row 0's average",
    },
    "12_communicating_less": {RECORDED_RUN: "On the faster links, what the model leaves out"},
    "bug_hunt": {
        ASSERTED: "The losses agree to the rounding | The weights agree as closely | The cell finds"
        " the parameters",
        MECHANISM: "Every line of that output is a symptom | Adam divides it by its own running"
        " | **Does the fixed script learn?** | Train longer: 30 steps",
    },
    "diagnosis_lab": {
        ASSERTED: "Its compute takes tens of milliseconds | That short time on the last rank"
        " | The cell below checks what the table shows | The cell below checks what the report"
        " | The cell below shows it and checks | Without the check, gloo noticed only",
        MECHANISM: "An all-reduce cannot finish on any rank | The lab injects a 40 ms"
        " | Would a longer timeout | An all-reduce completes only when | Collectives are matched"
        " | First estimate how much | Each pays a fixed cost | The second configuration of the cell"
        " | Whether the DDP with default buckets | Compute the algbw | The same check settles"
        " | In a ring or tree all-reduce | A \"busbw\" above | With NVLink SHARP"
        " | So before you call"
        " | The cells below start fresh ranks | First a fault the lab has not shown | With § ("
        " | gloo's groups keep the same records | The cell then matches the records"
        " | That is 's answer",
        RECORDED_RUN: "On a GPU backward runs on the device | **Recorded on a GPU.**",
    },
}


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_every_sentence_that_compares_beside_a_measurement_follows_from_the_run(path):
    nb = load(path)
    missing = unguarded(nb, general(path.stem))
    assert not missing, (
        f"{path.name}: these sentences compare or judge what the run beside them measured, and "
        "nothing keeps them true on the next build: glue the words that depend on the run "
        "(prose.glue), check the claim in a hidden cell (prose.holds('<words of the "
        "sentence>', condition, measured)), or list its first words in GENERAL of "
        "tests/test_prose_numbers.py with the reason it holds on every run:\n  "
        + "\n  ".join(missing))
    listed = [g for g in general(path.stem)
              if not any(s.startswith(g) for _, s in beside_a_measurement(nb))]
    assert not listed, f"{path.name}: GENERAL lists {listed}, which no longer start a sentence"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_every_claim_a_cell_checks_is_words_of_the_text(path):
    nb = load(path)
    text = " ".join(s for c in cells(nb, "markdown") for s in sentences(source(c)))
    stale = [c for c in checked_claims(nb) if c not in text]
    assert not stale, (f"{path.name}: prose.holds checks {stale}, which the text no longer says: "
                       "check what the sentence now says")


def test_a_comparing_sentence_beside_a_measurement_is_found_unless_glued_checked_or_listed():
    def code(text, tags=()):
        return {"cell_type": "code", "source": text, "metadata": {"tags": list(tags)},
                "outputs": []}

    text = ("Overlap saved time. It took {glue:text}`x` less. Ours is faster than theirs. "
            "The ring is blue.\n\n## Next\n\nThis one is faster, in a section of its own.")
    nb = {"cells": [code("t = measure()", ["nbval-ignore-output"]),
                    code("prose.glue('x', 1)", ["remove-cell"]),
                    {"cell_type": "markdown", "source": text, "metadata": {}}]}
    assert unguarded(nb, []) == ["Overlap saved time.", "Ours is faster than theirs."]
    nb["cells"][1]["source"] = "prose.holds('Ours is faster', ours < theirs, 'what ran')"
    assert checked_claims(nb) == ["Ours is faster"]
    assert unguarded(nb, ["Overlap saved"]) == []
    nb["cells"][0]["metadata"]["tags"] = []  # no measurement beside it: nothing to keep true
    assert beside_a_measurement(nb) == []


def test_holds_names_the_sentence_and_what_ran_and_compared_chooses_the_words():
    prose.holds("overlap saved time", True, "a saving")
    with pytest.raises(prose.ProseMismatch, match="'overlap saved time'.*cost 3 ms"):
        prose.holds("overlap saved time", False, "a step where overlap cost 3 ms")
    with pytest.raises(ValueError):
        prose.holds("  ", True, "")
    words = {"more": "slower", "less": "faster", "same": "as fast"}
    assert [prose.compared(a, 10.0, **words) for a in (12, 8, 10.5)] == [
        "slower", "faster", "as fast"]


def stray_values(nb: dict) -> list[str]:
    """The values a cell the website shows printed by leaving a string as its last expression
    (a glue call's return value, ``'42.3 ms'``): ``"cell N: 'value'"``."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or HIDDEN & set(cell["metadata"].get("tags", [])):
            continue
        for out in cell.get("outputs", []):
            text = (out.get("data") or {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            if out.get("output_type") == "execute_result" and text[:1] in "'\"" and text:
                found.append(f"cell {i}: {text[:60]}")
    return found


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.stem)
def test_no_cell_on_the_page_shows_a_stray_value(path):
    stray = stray_values(load(executed_copy(path)))
    assert not stray, (f"{path.name}: cells on the page show a value left as their last "
                       f"expression (end the cell with a statement, or hide it): {stray}")


def test_a_stray_value_is_found_in_a_shown_cell_only():
    result = {"output_type": "execute_result", "data": {"text/plain": "'42.3 ms'"}}
    shown = {"cell_type": "code", "source": "", "metadata": {}, "outputs": [result]}
    hidden = {"cell_type": "code", "source": "", "metadata": {"tags": ["remove-cell"]},
              "outputs": [result]}
    assert stray_values({"cells": [hidden, shown]}) == ["cell 1: '42.3 ms'"]
