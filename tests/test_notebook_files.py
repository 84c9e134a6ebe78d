"""The chapter notebooks as saved in the repository: valid nbformat 4.5, without outputs.

The book build executes them; outputs saved in the source would go stale as the package moves,
and cells without ids make nbformat warn (and, from nbformat 6, fail) on every read.
"""

import ast
import importlib.util
import json
import re
import sys
import types
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "chapters").glob("*.ipynb"))


def test_there_are_chapter_notebooks():
    assert len(NOTEBOOKS) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_saved_valid_and_without_outputs(path):
    raw = json.loads(path.read_text())  # as saved: nbformat.read would fill in missing ids
    ids = [cell.get("id") for cell in raw["cells"]]
    missing = [i for i, cell_id in enumerate(ids) if not cell_id]
    assert not missing, f"{path.name}: cells {missing} have no id; add one (any 8 hex digits)"
    assert len(set(ids)) == len(ids), f"{path.name}: cell ids repeat"
    nbformat.validate(nbformat.from_dict(raw))
    executed = [
        i
        for i, cell in enumerate(raw["cells"])
        if cell["cell_type"] == "code" and (cell["outputs"] or cell["execution_count"])
    ]
    assert not executed, f"{path.name}: cells {executed} were saved with outputs; clear them"


def _install_cell_tool():
    """tools/install_cell.py, loaded as a module (tools/ is not a package)."""
    path = ROOT / "tools" / "install_cell.py"
    spec = importlib.util.spec_from_file_location("install_cell", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_installs_the_package_where_it_is_missing(path):
    """Every notebook opens with the same install cell, as tools/install_cell.py writes it for
    the repository _config.yml names (Colab and Kaggle have no dpcourse)."""
    tool = _install_cell_tool()
    first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
    assert first.get("id") == tool.CELL_ID and "".join(first["source"]) == tool.cell_source(), (
        f"{path.name}: its first code cell is not the install cell of tools/install_cell.py "
        "(or the repository in _config.yml changed): run python tools/install_cell.py"
    )


def _run_install_cell(source, monkeypatch):
    """Run the install cell where dpcourse cannot be imported; return the pip commands it ran."""
    commands = []

    def run(command, check):
        commands.append(command)
        monkeypatch.delitem(sys.modules, "dpcourse", raising=False)  # "installed"

    monkeypatch.setitem(sys.modules, "dpcourse", None)  # None in sys.modules: ImportError
    monkeypatch.setitem(sys.modules, "subprocess", types.SimpleNamespace(run=run))
    exec(compile(source, "install-cell", "exec"), {})
    return commands


def _install_source(site="", repository="", needs=("numpy",)):
    return _install_cell_tool().TEMPLATE.format(
        site=site, repository=repository, needs=" ".join(needs),
        needs_list=", ".join(f'"{n}"' for n in needs))


def test_install_cell_with_nowhere_to_install_from_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no wheel beside the notebook
    with pytest.raises(ImportError, match=r"course \.zip") as error:
        _run_install_cell(_install_source(), monkeypatch)
    assert "pip install --no-deps -e . && pip install numpy" in str(error.value)
    assert "dpcourse .whl" in str(error.value)


def test_install_cell_takes_the_wheel_beside_the_notebook_first(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dpcourse-0.1.0-py3-none-any.whl").write_bytes(b"")
    source = _install_source(site="https://example.org/course/",
                             repository="https://github.com/example/course")
    (package,) = _run_install_cell(source, monkeypatch)  # numpy imports: nothing else installed
    assert package[-2:] == ["--no-deps", str(tmp_path / "dpcourse-0.1.0-py3-none-any.whl")]


def test_install_cell_takes_the_site_then_the_repository(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    source = _install_source(site="https://example.org/course/",
                             repository="https://github.com/example/course")
    (package,) = _run_install_cell(source, monkeypatch)
    assert package[-5:] == ["--no-deps", "--no-index", "--find-links",
                            "https://example.org/course/downloads/index.html", "dpcourse"]
    url = "https://github.com/example/course"
    (package,) = _run_install_cell(_install_source(repository=url), monkeypatch)
    assert package[-2:] == ["--no-deps", f"dpcourse @ git+{url}"]  # torch stays as it is


def test_install_cell_installs_only_the_needs_that_are_missing(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    source = _install_source(repository="https://github.com/example/course",
                             needs=("numpy", "no_such_module_for_the_test"))
    package, needs = _run_install_cell(source, monkeypatch)
    assert needs[-1] == "no_such_module_for_the_test" and "numpy" not in needs
    tool = _install_cell_tool()
    assert "torch" not in tool.needs() and "numpy" in tool.needs()


# A cell that draws: a matplotlib figure shown, an animation, a widget that draws figures.
DRAWS = re.compile(r"plt\.show\(\)|\.to_jshtml\(|_explorer\(")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_figure_has_alt_text(path):
    """Issue 33: each cell that draws says what it draws, in its metadata, for readers who do not
    see the figure: `"mystnb": {"image": {"alt": "..."}}` (myst-nb writes it into the figure's
    <img>; _ext/accessible_site.py into animations and widgets). tests/test_browser.py checks the
    built pages; this also covers cells that draw only on some machines (a GPU's)."""
    raw = json.loads(path.read_text())
    missing = []
    for i, cell in enumerate(raw["cells"]):
        if cell["cell_type"] != "code" or not DRAWS.search("".join(cell["source"])):
            continue
        alt = cell["metadata"].get("mystnb", {}).get("image", {}).get("alt", "")
        if len(alt.split()) < 8:
            missing.append(f"cell {i} (id {cell['id']}): alt {alt!r}")
    assert not missing, (
        f"{path.name}: cells that draw without alt text saying what they show (add "
        '"mystnb": {"image": {"alt": "..."}} to the cell\'s metadata):\n' + "\n".join(missing)
    )


# --- Issue 42, item 3: no machinery on the page ------------------------------------------------
# The website shows the idea, not the course's plumbing: no glue call (or other use of
# dpcourse.harness.prose), no import of the harness other than run_ranks and check, no cell that
# starts or closes a pool of ranks. They go in cells tagged remove-cell (hidden on the website;
# in the notebook they still run, top to bottom). Hidden cells say so in their first line.
HIDDEN_TAGS = {"remove-cell", "remove-input"}
SHOWN_IMPORTS = {("dpcourse.harness.launch", "run_ranks"), ("dpcourse.harness.exercises", "check")}


def machinery_lines(notebook: dict) -> list[str]:
    """``"cell N (id): line"`` for each statement of the course's machinery in a cell the website
    shows."""
    pools = set()
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            pools |= set(re.findall(r"(\w+)\s*=\s*\[?RankPool\(", "".join(cell["source"])))
    found = []
    for i, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code" or HIDDEN_TAGS & set(cell["metadata"].get("tags", [])):
            continue
        source = "".join(cell["source"])
        lines = source.splitlines()
        nodes = sorted(ast.walk(ast.parse(source)), key=lambda n: getattr(n, "lineno", 0))
        for node in nodes:
            machinery = False
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "dpcourse.harness"):
                machinery = any((node.module, a.name) not in SHOWN_IMPORTS for a in node.names)
            elif isinstance(node, ast.Import):
                machinery = any(a.name.startswith("dpcourse.harness") for a in node.names)
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                owner = getattr(func.value, "id", "") if isinstance(func, ast.Attribute) else ""
                machinery = (name in ("glue", "RankPool") or owner == "prose"
                             or (name == "close" and owner in pools | {"pool"}))
            if machinery:
                found.append(f"cell {i} ({cell.get('id')}): {lines[node.lineno - 1].strip()}")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_machinery_on_the_page(path):
    shown = machinery_lines(json.loads(path.read_text()))
    assert not shown, (
        f"{path.name}: the website shows the course's machinery in {len(shown)} lines (glue, "
        "harness imports other than run_ranks and check, pools of ranks): move them into a cell "
        "tagged remove-cell that says in its first line what it does:\n  " + "\n  ".join(shown))


def test_the_machinery_counter_sees_what_it_should():
    cell = {"cell_type": "code", "id": "x", "metadata": {}, "outputs": [], "source": (
        "from dpcourse.harness import prose\n"
        "from dpcourse.harness.launch import RankPool, run_ranks\n"
        "from dpcourse.harness.exercises import check\npool = RankPool(2).start()\n"
        "t = run_ranks(f, 2)\nprose.glue('t', t)\npool.close()\n")}
    found = machinery_lines({"cells": [cell]})
    assert [line.split(": ", 1)[1] for line in found] == [
        "from dpcourse.harness import prose",
        "from dpcourse.harness.launch import RankPool, run_ranks",
        "pool = RankPool(2).start()", "prose.glue('t', t)", "pool.close()"]
    cell["metadata"]["tags"] = ["remove-cell"]
    assert machinery_lines({"cells": [cell]}) == []
