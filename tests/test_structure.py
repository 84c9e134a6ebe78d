"""The package reads in the book's order: one chapter per module, no look-ahead, short files.

(a) every module under ``src/dpcourse`` names its chapter on the last line of its docstring
(``Chapter 7: DistributedDataParallel from scratch.``; chapter 0 is the course-wide runtime,
launcher and tooling); (b) no lesson module imports a module of a later chapter; (c) no lesson
module is over 330 lines. ``bench/``, ``exercises/``, ``train.py`` and the private plumbing
(``_*.py``, ``_launch/``) are not lessons, so (b) and (c) leave them out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dpcourse"
CHAPTER = re.compile(r"^Chapter (\d+)\b")
MAX_LINES = 330


def module_name(path: Path) -> str:
    parts = ["dpcourse", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def chapter_of(path: Path) -> int | None:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = doc.strip().splitlines()
    match = CHAPTER.match(lines[-1]) if lines else None
    return int(match.group(1)) if match else None


def is_lesson(name: str) -> bool:
    parts = name.split(".")[1:]
    if not parts:
        return False  # the package itself
    if parts[0] in ("bench", "exercises", "train"):
        return False
    return not any(part.startswith("_") for part in parts)


def imported_modules(name: str, path: Path) -> set[str]:
    """The ``dpcourse`` modules that ``path`` imports anywhere (functions' bodies too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from dpcourse import ddp` imports the module dpcourse.ddp
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]  # `import dpcourse.x.y` -> the module it names
            if target and target != name:
                found.add(target)
    return found


def test_every_module_names_its_chapter():
    missing = [
        f"{name} ({path.relative_to(PACKAGE.parents[1])})"
        for name, path in MODULES.items()
        if chapter_of(path) is None
    ]
    assert not missing, (
        f"{len(missing)} module(s) do not end their docstring with a line 'Chapter N: ...' "
        "(N = the chapter they serve, 0 for the course-wide runtime and tooling):\n  "
        + "\n  ".join(missing)
    )


def test_no_lesson_imports_a_later_chapter():
    chapters = {name: chapter_of(path) for name, path in MODULES.items()}
    broken = []
    for name, path in MODULES.items():
        mine = chapters[name]
        if not is_lesson(name) or mine is None:
            continue
        for target in sorted(imported_modules(name, path)):
            theirs = chapters.get(target)
            if theirs is not None and theirs > mine:
                broken.append(f"{name} (chapter {mine}) imports {target} (chapter {theirs})")
    assert not broken, "lesson modules import a later chapter's module:\n  " + "\n  ".join(broken)


def test_no_lesson_module_is_too_long_to_read_in_one_sitting():
    long = [
        f"{name}: {n} lines"
        for name, path in MODULES.items()
        if is_lesson(name) and (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, f"lesson modules over {MAX_LINES} lines (split them by concept):\n  " + (
        "\n  ".join(long)
    )


def test_the_guard_sees_imports_at_any_depth():
    source = PACKAGE / "averaging.py"
    imports = imported_modules("dpcourse.averaging", source)
    assert {"dpcourse.replication", "dpcourse.runtime"} <= imports
    assert imported_modules("dpcourse.collectives.ring", PACKAGE / "collectives" / "ring.py")
