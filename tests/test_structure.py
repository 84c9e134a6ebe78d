"""The package reads as the book: folders per part, lessons apart from the machinery, one map.

(a) every module names its chapter on the last line of its docstring (``Chapter 7: ...``;
chapter 0 is the course-wide runtime and machinery; ``Appendix: ...`` for the appendices, which
come after every chapter); (b) no lesson module imports a module of a
later chapter; (c) lesson code (everything outside ``dpcourse.harness``) never imports the
machinery that runs and checks the course; (d) imports sit at the top of a module, except where
a comment on the line (or the line above) says ``import here: <why>`` (a cycle, an optional
dependency, a later chapter loaded only when asked for); (e) no private name (``_x``) crosses a
module border; (f) CONTRIBUTING.md's map is the one ``python -m dpcourse.harness.package_map``
writes from the docstrings. Each checker is also shown failing on a made-up violation, so that
none of these tests can pass by seeing nothing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dpcourse.harness import package_map

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dpcourse"
CHAPTER = re.compile(r"^(?:Chapter (\d+)|Appendix)\b")
APPENDIX = 99  # the appendices (the lab, the bug hunt) come after every chapter
HARNESS = "dpcourse.harness"
IMPORT_HERE = "import here:"


def module_name(path: Path) -> str:
    parts = ["dpcourse", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {
    module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
}


def chapter_of(source: str) -> int | None:
    doc = ast.get_docstring(ast.parse(source)) or ""
    lines = doc.strip().splitlines()
    match = CHAPTER.match(lines[-1]) if lines else None
    if match is None:
        return None
    return int(match.group(1)) if match.group(1) else APPENDIX


def is_lesson(name: str) -> bool:
    """Lesson code: every module but the package itself and the machinery (``harness``)."""
    return name != "dpcourse" and not (name == HARNESS or name.startswith(HARNESS + "."))


def _import_targets(node: ast.AST, package: str) -> list[tuple[str, list[str]]]:
    """``[(module, [names imported from it])]`` for an import statement."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        return [(base, [a.name for a in node.names])]
    return []


def imported_modules(
    name: str, source: str, modules: dict | None = None, declared: bool = True
) -> set[str]:
    """The ``dpcourse`` modules that ``source`` (the module ``name``) imports, anywhere in it;
    with ``declared=False``, leaving out imports that say ``import here: <why>`` on their line
    (a look-ahead the module declares, such as the trainer's chapter 9 strategy)."""
    modules = MODULES if modules is None else modules
    lines = source.splitlines()
    package = name if name in modules and str(modules[name]).endswith("__init__.py") else (
        name.rpartition(".")[0])
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not declared and IMPORT_HERE in lines[getattr(node, "lineno", 1) - 1]:
            continue
        for base, names in _import_targets(node, package):
            # `from dpcourse.ddp import buckets` imports the module dpcourse.ddp.buckets
            targets = [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names] or [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]  # `import dpcourse.x.y` -> its module
                if target and target != name:
                    found.add(target)
    return found


def machinery_imports(name: str, source: str) -> list[str]:
    """The imports of the machinery (``dpcourse.harness``) in lesson module ``name``'s source."""
    if not is_lesson(name):
        return []
    return sorted(t for t in imported_modules(name, source) if not is_lesson(t) and t != "dpcourse")


def imports_inside_functions(source: str) -> list[int]:
    """Line numbers of imports inside function bodies without an ``import here:`` reason."""
    lines = source.splitlines()
    bad = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                here = lines[node.lineno - 1]
                above = lines[node.lineno - 2] if node.lineno > 1 else ""
                if IMPORT_HERE not in here and IMPORT_HERE not in above:
                    bad.append(node.lineno)
    return sorted(set(bad))


def private_names_crossing(name: str, source: str, modules: dict | None = None) -> list[str]:
    """Private names (``_x``, not dunders) that module ``name`` takes from another dpcourse
    module: ``from m import _x``, or ``m._x`` where ``m`` is an imported dpcourse module."""
    modules = MODULES if modules is None else modules
    tree = ast.parse(source)
    package = name if name in modules and str(modules[name]).endswith("__init__.py") else (
        name.rpartition(".")[0])
    module_aliases: dict[str, str] = {}
    crossing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            (base, names), = _import_targets(node, package)
            if not base.startswith("dpcourse"):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    module_aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    crossing.append(f"from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("dpcourse") and alias.asname:
                    module_aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            crossing.append(f"{module_aliases[node.value.id]}.{node.attr}")
    return sorted(set(crossing))


# ------------------------------------------------------------------------------ the rules
def test_every_module_names_its_chapter():
    missing = [f"{name} ({path.relative_to(PACKAGE.parents[1])})"
               for name, path in MODULES.items() if chapter_of(path.read_text()) is None]
    assert not missing, (
        f"{len(missing)} module(s) do not end their docstring with a line 'Chapter N: ...' "
        "(N = the chapter they serve, 0 for the course-wide runtime and machinery):\n  "
        + "\n  ".join(missing)
    )


def test_no_lesson_imports_a_later_chapter():
    chapters = {name: chapter_of(path.read_text()) for name, path in MODULES.items()}
    broken = []
    for name, path in MODULES.items():
        mine = chapters[name]
        if not is_lesson(name) or mine is None:
            continue
        for target in sorted(imported_modules(name, path.read_text(), declared=False)):
            theirs = chapters.get(target)
            if theirs is not None and theirs > mine and is_lesson(target):
                broken.append(f"{name} (chapter {mine}) imports {target} (chapter {theirs})")
    assert not broken, "lesson modules import a later chapter's module:\n  " + "\n  ".join(broken)


def test_lesson_code_never_imports_the_machinery():
    broken = [f"{name} imports {', '.join(found)}" for name, path in MODULES.items()
              if (found := machinery_imports(name, path.read_text()))]
    assert not broken, (
        "lesson code imports dpcourse.harness (the launcher, cluster, audit, checks): move the "
        "code that needs it into the harness, or pass what it needs in:\n  " + "\n  ".join(broken)
    )


def test_imports_sit_at_the_top_of_each_module():
    broken = [f"{path.relative_to(PACKAGE.parents[1])}: line(s) {lines}"
              for path in MODULES.values()
              if (lines := imports_inside_functions(path.read_text()))]
    assert not broken, (
        "imports inside functions hide what a module depends on: move them to the top, or say "
        f"why they must stay with a comment '# {IMPORT_HERE} <a cycle, an optional dependency, "
        "...>':\n  " + "\n  ".join(broken)
    )


def test_no_private_name_crosses_a_module_border():
    broken = [f"{name}: {', '.join(found)}" for name, path in MODULES.items()
              if (found := private_names_crossing(name, path.read_text()))]
    assert not broken, (
        "private names used from another module (make them public, with a docstring, or keep "
        "the code that needs them in their module):\n  " + "\n  ".join(broken)
    )


def test_the_map_in_contributing_is_the_one_the_docstrings_write():
    text = package_map.CONTRIBUTING.read_text()
    assert package_map.update(text) == text, (
        "CONTRIBUTING.md's package map disagrees with the modules' docstrings (a module, a "
        "folder or a docstring changed): run `python -m dpcourse.harness.package_map --write`"
    )


def test_every_folder_is_in_the_books_order():
    folders = {m.folder for m in package_map.modules()}
    assert folders <= set(package_map.FOLDERS), folders - set(package_map.FOLDERS)


# ------------------------------------------------------------- each checker, shown failing
FAKE = {"dpcourse.ddp.ddp": Path("ddp.py"), "dpcourse.harness.launch": Path("__init__.py"),
        "dpcourse.runtime": Path("runtime.py"), "dpcourse.ddp": Path("__init__.py")}


@pytest.mark.parametrize("source", [
    "from dpcourse.harness.launch import run_ranks\n",
    "def f():\n    from dpcourse.harness import launch  # import here: a cycle\n",
    "import dpcourse.harness.launch\n",
])
def test_the_guard_sees_lesson_code_importing_the_machinery(source, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "MODULES", {**MODULES, **FAKE}, raising=False)
    assert machinery_imports("dpcourse.ddp.ddp", source) == ["dpcourse.harness.launch"]
    assert machinery_imports("dpcourse.harness.bench.ddp", source) == []  # machinery may


def test_the_guard_sees_imports_inside_functions_and_accepts_a_reason():
    source = ("import os\n\ndef f():\n    import torch\n    return torch\n\n"
              "def g():\n    # import here: optional, absent outside Jupyter\n    import IPython\n"
              "    from x import y  # import here: a cycle\n")
    assert imports_inside_functions(source) == [4]


def test_the_guard_sees_private_names_crossing():
    source = ("from dpcourse.ddp import ddp\nfrom dpcourse.runtime import _env_int\n"
              "ddp._secret(1)\nddp.public(2)\n")
    assert private_names_crossing("dpcourse.harness.launch", source, {**MODULES, **FAKE}) == [
        "dpcourse.ddp.ddp._secret", "from dpcourse.runtime import _env_int"]


def test_the_guard_sees_a_map_that_disagrees_with_the_docstrings(tmp_path):
    infos = package_map.modules()
    changed = [package_map.ModuleInfo(m.name, m.folder, m.chapter,
                                      m.summary + " (edited by hand)" if i == 3 else m.summary,
                                      m.lines, m.path) for i, m in enumerate(infos)]
    text = package_map.CONTRIBUTING.read_text()
    by_hand = package_map.update(text, package_map.render(changed))
    assert by_hand != text and package_map.update(by_hand) == text  # --write puts it right
    with pytest.raises(ValueError, match="not in package_map.FOLDERS"):
        (tmp_path / "newpart").mkdir()
        (tmp_path / "newpart" / "x.py").write_text('"""X.\n\nChapter 3: x."""\n')
        package_map.modules(tmp_path)


def test_the_guard_sees_imports_at_any_depth():
    source = (PACKAGE / "replicas" / "averaging.py").read_text()
    imports = imported_modules("dpcourse.replicas.averaging", source)
    assert {"dpcourse.replicas.replication", "dpcourse.runtime"} <= imports


def chapter_table_names(text: str) -> list[str]:
    """The modules CONTRIBUTING.md's chapter table names in its last column ("`ddp` (`ddp`,
    `checks`)" names dpcourse.ddp, dpcourse.ddp.ddp and dpcourse.ddp.checks; words after a ";"
    inside the brackets are prose)."""
    names = []
    for line in text.split("## The course", 1)[1].split("\n## ", 1)[0].splitlines():
        if not line.startswith("| ") or line.startswith(("| # ", "|---")):
            continue
        for match in re.finditer(r"`([\w.]+)`(?: \(([^)]*)\))?", line.rsplit(" | ", 1)[-1]):
            names.append(f"dpcourse.{match.group(1)}")
            modules_listed = (match.group(2) or "").split(";")[0]  # after a ";": prose
            names += [f"dpcourse.{match.group(1)}.{inner}"
                      for inner in re.findall(r"`([\w.]+)`", modules_listed)]
    return names


def test_the_chapter_table_names_modules_that_exist():
    names = chapter_table_names(package_map.CONTRIBUTING.read_text())
    assert len(names) > 40 and "dpcourse.ddp.checks" in names
    missing = [n for n in names if n not in MODULES]
    assert not missing, f"CONTRIBUTING.md's chapter table names modules that are not: {missing}"
