"""The student edition: the book's sources with every solution taken out.

``python -m dpcourse.exercises student --out _build/student`` writes a copy of ``_config.yml``,
``_toc.yml`` and ``chapters/`` in which

* every ``{solution}`` directive is removed from the text (and ``hide_solutions`` is set, so
  sphinx-exercise drops any that remain from the HTML);
* in code, the lines between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` become
  ``raise NotImplementedError(...)``, so the learner's function keeps its name and signature and
  its check reports "not attempted" until it is written;
* outputs are cleared and the ``hide-input`` tag of solution cells is dropped.

``make student`` then builds the student website from it; its notebooks are the hand-outs.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

__all__ = [
    "strip_solution_directives",
    "strip_solution_code",
    "student_notebook",
    "make_student_edition",
    "solution_lines",
]

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|:{3,})\{solution\}")
_LABEL = re.compile(r":label:\s*(ex-[\w-]+)")


def strip_solution_directives(text: str) -> str:
    """Remove every ``{solution}`` block (backtick or colon fence, any fence length)."""
    out: list[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        fence = m.group("fence")
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        i += 1
        while i < len(lines) and not closing.match(lines[i]):
            i += 1
        i += 1  # the closing fence; an unclosed block runs to the end, like MyST reads it
    return re.sub(r"\n{3,}", "\n\n", "".join(out))


def strip_solution_code(source: str, label: str | None = None) -> str:
    """Replace the lines between the solution markers with ``raise NotImplementedError``."""
    out: list[str] = []
    inside = False
    for line in source.splitlines(keepends=True):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r} in:\n{source}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            what = f"Exercise {label}: write" if label else "Write"
            out.append(f'{indent}raise NotImplementedError("{what} your solution here")\n')
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r} in:\n{source}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r} in:\n{source}")
    return "".join(out)


def student_notebook(nb: dict) -> dict:
    """The student version of a notebook (as parsed JSON); the input is not modified."""
    nb = json.loads(json.dumps(nb))
    cells = []
    label = None
    for cell in nb["cells"]:
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        labels = _LABEL.findall(source)
        if cell["cell_type"] == "markdown":
            label = labels[-1] if labels else label
            source = strip_solution_directives(source)
            if not source.strip():
                continue
        elif cell["cell_type"] == "code":
            source = strip_solution_code(source, label)
            tags = cell.get("metadata", {}).get("tags", [])
            if "solution" in tags:
                cell["metadata"]["tags"] = [t for t in tags if t != "hide-input"]
            cell["outputs"] = []
            cell["execution_count"] = None
        cell["source"] = source.splitlines(keepends=True)
        cells.append(cell)
    nb["cells"] = cells
    nb.setdefault("metadata", {})["dpcourse"] = {"edition": "student"}
    return nb


def _student_text_notebook(text: str) -> str:
    """A MyST markdown page or notebook (``.md``): directives and code markers alike."""
    return strip_solution_code(strip_solution_directives(text))


def make_student_edition(root: Path, out: Path) -> list[Path]:
    """Write the student edition of the book at ``root`` into ``out``; return its notebooks."""
    root, out = Path(root), Path(out)
    if out.resolve() == root.resolve():
        raise ValueError("the student edition must go to a folder of its own")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(
        root / "chapters",
        out / "chapters",
        ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"),
    )
    shutil.copy2(root / "_toc.yml", out / "_toc.yml")
    for extra in ("_ext", "assets", "_vendor"):  # what _config.yml refers to, where present
        if (root / extra).is_dir():
            shutil.copytree(root / extra, out / extra,
                            ignore=shutil.ignore_patterns("__pycache__"))
    config = yaml.safe_load((root / "_config.yml").read_text())
    config["title"] = f"{config.get('title', 'Book')} (student edition)"
    config.setdefault("sphinx", {}).setdefault("config", {})["hide_solutions"] = True
    (out / "_config.yml").write_text(
        "# Generated by `python -m dpcourse.exercises student`: edit the original instead.\n"
        + yaml.safe_dump(config, sort_keys=False)
    )
    written = []
    for path in sorted((out / "chapters").rglob("*")):
        if path.suffix == ".ipynb":
            nb = student_notebook(json.loads(path.read_text()))
            path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            written.append(path)
        elif path.suffix == ".md":
            path.write_text(_student_text_notebook(path.read_text()))
    return written


def solution_lines(root: Path, min_length: int = 25) -> list[str]:
    """Distinctive lines of every solution in the book at ``root`` (directive bodies and marked
    code), for checking that a student edition does not leak them. Lines that also appear
    outside the solutions (a common ``rank = dist.get_rank()``, or a call the narrative quotes
    inline) are not distinctive."""
    secret: set[str] = set()
    public: list[str] = []
    for path in sorted((Path(root) / "chapters").rglob("*")):
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            sources = ["".join(c["source"]) for c in cells]
        elif path.suffix == ".md":
            sources = [path.read_text()]
        else:
            continue
        for src in sources:
            for _, body in re.findall(r"(`{3,}|:{3,})\{solution\}.*?\n(.*?)\n\1", src, re.S):
                secret.update(ln.strip() for ln in body.splitlines())
            for code in re.findall(rf"{BEGIN}\n(.*?){END}", src, re.S):
                secret.update(ln.strip() for ln in code.splitlines())
            stripped = strip_solution_code(strip_solution_directives(src))
            public.append(stripped)
    public_text = "\n".join(public)
    return sorted(
        ln
        for ln in secret
        if len(ln) >= min_length
        and not ln.startswith(("```", ":class:", ":::"))
        and ln not in public_text
    )
