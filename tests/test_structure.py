"""The package reads as the book: folders per part, lessons apart from the machinery, one map.

Two rules are import-linter contracts in pyproject.toml (``lint-imports``, run by ``make lint``):
lesson code (everything outside ``dpcourse.harness``) never imports the machinery, and no lesson
module imports a later chapter's, even through another module. One is ruff's: imports sit at the
top of a module (PLC0415). This file checks what those tools cannot say: (a) every module names
its chapter on the last line of its docstring (``Chapter 7: ...``; chapter 0 is the course-wide
runtime and machinery; ``Appendix: ...`` for the appendices, which come after every chapter);
(b) the contract's layers are those chapters, and the few package ``__init__`` modules that cannot
be a layer of their own (their modules belong to several chapters) import no later chapter;
(c) an import that must stay inside a function says why (``# import here: <why>``); (d) no
private name (``_x``) crosses a module border; (e) CONTRIBUTING.md's map is the one ``python -m
dpcourse.harness.package_map`` writes from the docstrings; and that the contracts hold, here too.
Each checker is also shown failing on a made-up violation, so that none of these tests can pass
by seeing nothing.
"""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

import pytest

from dpcourse.harness import package_map

try:  # the course's dev requirement; a GPU image without it skips the contracts' tests
    import grimp
    from importlinter.api import read_configuration
    from importlinter.contracts.layers import LayersContract
    from importlinter.contracts.protected import ProtectedContract
except ImportError:
    grimp = None
needs_linter = pytest.mark.skipif(grimp is None, reason="import-linter is not installed "
                                  "(requirements.txt has it): pip install import-linter==2.16")

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dpcourse"
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"
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


def reasonless_inner_imports(source: str) -> list[int]:
    """Line numbers of imports that ruff lets stay inside a function (``# noqa: PLC0415``)
    without an ``# import here: <why>`` comment on their line or in the comments and imports
    just above them."""
    lines = source.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if "noqa: PLC0415" not in line:
            continue
        j = i
        while IMPORT_HERE not in lines[j] and j > 0 and re.match(
                r"\s*(#|from |import )", lines[j - 1]):
            j -= 1
        if IMPORT_HERE not in lines[j]:
            bad.append(i + 1)
    return bad


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


def contracts() -> list:
    """pyproject.toml's import-linter contracts, as import-linter checks them."""
    config = read_configuration(str(PYPROJECT))
    kinds = {"layers": LayersContract, "protected": ProtectedContract}
    return [kinds[options["type"]](options["name"], config["session_options"], options)
            for options in config["contracts_options"]]


def broken_contracts(graph) -> list[str]:
    return [c.name for c in contracts() if not c.check(copy.deepcopy(graph), verbose=False).kept]


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("dpcourse", cache_dir=None)


@needs_linter
def test_the_package_keeps_its_import_contracts(graph):
    assert {c.type_name for c in contracts()} == {"layers", "protected"}
    assert not broken_contracts(graph), "run `lint-imports` (make lint) to see where"


def layers_of_chapters(layers: list | None = None) -> list[tuple[int, list[str]]]:
    """The layers contract's layers (or ``layers``), top first: (their chapter, the modules they
    name), the chapter read from the docstrings, one chapter per layer or a ValueError."""
    if layers is None:
        layers = next(c for c in contracts() if c.type_name == "layers").layers
    out = []
    for layer in layers:
        names = sorted(tail.name for tail in layer.module_tails)
        chapters = {chapter_of(MODULES[n].read_text()) for n in names if n in MODULES}
        if len(chapters) != 1 or len(names) != len([n for n in names if n in MODULES]):
            raise ValueError(f"a layer names modules of chapters {sorted(chapters)} (or modules "
                             f"that are not): {names}")
        out.append((chapters.pop(), names))
    return out


def split_packages() -> set[str]:
    """Lesson packages whose modules belong to several chapters: their ``__init__`` cannot be a
    layer of the contract (a layer is a module and everything under it)."""
    chapters = {name: chapter_of(path.read_text()) for name, path in MODULES.items()}
    return {name for name, path in MODULES.items()
            if path.name == "__init__.py" and is_lesson(name)
            and {chapters[n] for n in MODULES if n.startswith(name + ".")} != {chapters[name]}}


@needs_linter
def test_the_contracts_layers_are_the_chapters():
    layers, split = layers_of_chapters(), split_packages()
    order = [chapter for chapter, _ in layers]
    assert order == sorted(set(order), reverse=True), f"layers not latest chapter first: {order}"
    listed = {name: chapter for chapter, names in layers for name in names}
    unlisted = []
    for name, path in MODULES.items():
        if not is_lesson(name) or name in split:
            continue
        covering = [m for m in listed if name == m or name.startswith(m + ".")]
        if not covering:
            unlisted.append(f"{name} (chapter {chapter_of(path.read_text())})")
        elif listed[covering[0]] != chapter_of(path.read_text()):
            unlisted.append(f"{name}: its docstring says chapter {chapter_of(path.read_text())}, "
                            f"its layer in pyproject.toml chapter {listed[covering[0]]}")
    assert not unlisted, (
        "pyproject.toml's layers contract ([tool.importlinter]) must name every lesson module in "
        "its chapter's layer:\n  " + "\n  ".join(unlisted))


def test_split_packages_import_no_later_chapter():
    assert "dpcourse.collectives" in split_packages()
    chapters = {name: chapter_of(path.read_text()) for name, path in MODULES.items()}
    broken = [f"{name} (chapter {chapters[name]}) imports {target} (chapter {chapters[target]})"
              for name in sorted(split_packages())
              for target in imported_modules(name, MODULES[name].read_text())
              if chapters.get(target) is not None and chapters[target] > chapters[name]]
    assert not broken, "a package's __init__ imports a later chapter's module:\n  " + (
        "\n  ".join(broken))


def test_imports_inside_functions_say_why():
    broken = [f"{path.relative_to(PACKAGE.parents[1])}: line(s) {lines}"
              for path in MODULES.values() if (lines := reasonless_inner_imports(path.read_text()))]
    assert not broken, (
        "an import that stays inside a function (ruff's noqa: PLC0415) says why on a comment "
        f"above it, '# {IMPORT_HERE} <a cycle, an optional dependency, ...>':\n  "
        + "\n  ".join(broken))


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


@needs_linter
@pytest.mark.parametrize("importer,imported,broken", [
    # lesson code importing the machinery
    ("dpcourse.ddp.ddp", "dpcourse.harness.launch", "machinery"),
    # chapter 6 importing chapter 7, and chapter 5 reaching chapter 10 through a module
    ("dpcourse.collectives.ring", "dpcourse.ddp.ddp", "later chapter"),
    ("dpcourse.collectives.p2p", "dpcourse.cost.simulate", "later chapter"),
    # chapter 6's package importing chapter 10 through its __init__
    ("dpcourse.collectives.ops", "dpcourse.collectives", "later chapter"),
])
def test_the_contracts_see_a_made_up_violation(graph, importer, imported, broken):
    graph = copy.deepcopy(graph)
    graph.add_import(importer=importer, imported=imported)
    if importer == "dpcourse.collectives.ops":
        graph.add_import(importer=imported, imported="dpcourse.collectives.hierarchical")
    assert [name for name in broken_contracts(graph) if broken in name], (importer, imported)


def test_the_guard_sees_imports_inside_functions_without_a_reason():
    source = ("import os\n\ndef f():\n    import torch  # noqa: PLC0415\n    return torch\n\n"
              "def g():\n    # import here: optional, absent outside Jupyter\n"
              "    import IPython  # noqa: PLC0415\n    from x import y  # noqa: PLC0415\n"
              "    z = 1\n    import w  # noqa: PLC0415\n")
    assert reasonless_inner_imports(source) == [4, 12]


@needs_linter
def test_the_guard_sees_a_layer_that_is_not_its_chapter():
    wrong = copy.deepcopy(next(c for c in contracts() if c.type_name == "layers").layers)
    wrong[-1].module_tails.add(next(iter(wrong[1].module_tails)))  # a chapter 11 module in 0
    with pytest.raises(ValueError, match="a layer names modules of chapters"):
        layers_of_chapters(wrong)


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
