"""The course runs on every torch in pyproject.toml's range, 2.11 to 2.13.

requirements.txt pins torch 2.13.0 (the CPU build the course is written and tested on), while a
GPU image may bring 2.11.0 (one did, and an exercise using 2.13's
``torch.distributed.reduce_scatter_single`` broke on it). ``tests/torch_floor.json``, written by
``tools/torch_floor_names.py``, lists for each torch module the course uses the names that the
newest checked torch has and the floor lacks. The scan below fails on any attribute access or
``from M import name`` of such a name in src/, tests/ or the chapters' code cells, unless it is
guarded: ``getattr(mod, "name", default)`` / ``hasattr(mod, "name")`` (strings, not attribute
accesses), a file whose path contains ``_compat``, an import inside a ``try`` that catches
ImportError or AttributeError, or a line carrying ``# torch>=2.13 only: <reason>``.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = json.loads((ROOT / "tests" / "torch_floor.json").read_text(encoding="utf-8"))
ALLOW_COMMENT = re.compile(r"#\s*torch>=[\d.]+ only:\s*\S")
GUARDING_ERRORS = {"ImportError", "ModuleNotFoundError", "AttributeError"}


def _pyproject_torch() -> Requirement:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the dependencies line is enough
        match = re.search(r"^dependencies\s*=\s*(\[.*?\])", text, re.M | re.S)
        assert match, "pyproject.toml: no [project] dependencies"
        dependencies = ast.literal_eval(match.group(1))
    else:
        dependencies = tomllib.loads(text)["project"]["dependencies"]
    torch_reqs = [Requirement(d) for d in dependencies if Requirement(d).name == "torch"]
    assert len(torch_reqs) == 1, f"pyproject.toml: one torch dependency, found {dependencies}"
    return torch_reqs[0]


def test_installed_torch_is_in_the_supported_range():
    req = _pyproject_torch()
    assert str(req.specifier), "pyproject.toml: torch needs a range (torch>=floor,<ceiling)"
    installed = Version(torch.__version__)  # "2.13.0+cpu": the local part does not count
    assert req.specifier.contains(installed, prereleases=True), (
        f"torch {torch.__version__} is outside the course's supported range {req}"
        " (pyproject.toml); install a torch in that range, or widen it after checking"
        " (tools/torch_floor_names.py)"
    )
    floors = [s.version for s in req.specifier if s.operator == ">="]
    assert floors == [MANIFEST["floor"]], (
        f"tests/torch_floor.json was made for floor {MANIFEST['floor']}, pyproject.toml says"
        f" {req}: rerun tools/torch_floor_names.py with the new floor"
    )
    assert req.specifier.contains(MANIFEST["newest_checked"]), (
        f"tests/torch_floor.json was made with torch {MANIFEST['newest_checked']}, outside {req}"
    )


# ---------------------------------------------------------------------------------- the scan
def _known_modules(newer: dict[str, list[str]]) -> set[str]:
    known = set()
    for module in newer:
        parts = module.split(".")
        known.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return known


def _catches(handler: ast.ExceptHandler) -> bool:
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id in GUARDING_ERRORS for k in kinds)


def scan_units(units: list[tuple[str, str]], newer: dict[str, list[str]]):
    """Unguarded uses of a name in ``newer``, as ``where:line module.name``, and the units that
    do not parse. ``units`` share one namespace (a file, or a notebook's code cells): an alias
    imported in one cell counts in the others."""
    known = _known_modules(newer)
    aliases: dict[str, str] = {}  # local name -> torch module, from imports anywhere
    parsed, unparsed = [], []
    for where, source in units:
        try:
            parsed.append((where, source.splitlines(), ast.parse(source)))
        except SyntaxError:
            unparsed.append(where)

    def resolve(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = resolve(node.value)
            if base is not None and f"{base}.{node.attr}" in known:
                return f"{base}.{node.attr}"
        return None

    uses = []  # (where, lines, tree, node, module, name)
    for where, lines, tree in parsed:  # imports first, so that aliases are known everywhere
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        for node in sorted(imports, key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in known:
                        aliases[alias.asname] = alias.name
                    elif not alias.asname and alias.name.split(".")[0] == "torch":
                        aliases["torch"] = "torch"
            elif node.module and not node.level and node.module in known:
                for alias in node.names:
                    if alias.name in newer.get(node.module, ()):
                        uses.append((where, lines, tree, node, node.module, alias.name))
                    if f"{node.module}.{alias.name}" in known:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for _, _, tree in parsed:  # `c10d = torch.distributed.distributed_c10d`
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, module = node.targets[0], resolve(node.value)
                if isinstance(target, ast.Name) and module is not None:
                    aliases[target.id] = module
    for where, lines, tree in parsed:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                module = resolve(node.value)
                if module is not None and node.attr in newer.get(module, ()):
                    uses.append((where, lines, tree, node, module, node.attr))

    guarded: dict[int, set[int]] = {}  # per tree: ids of nodes in a try catching ImportError...
    found = []
    for where, lines, tree, node, module, name in uses:
        if id(tree) not in guarded:
            guarded[id(tree)] = {
                id(inner)
                for t in ast.walk(tree) if isinstance(t, ast.Try) and any(map(_catches, t.handlers))
                for stmt in t.body for inner in ast.walk(stmt)
            }
        line = lines[node.lineno - 1] if node.lineno <= len(lines) else ""
        if id(node) not in guarded[id(tree)] and not ALLOW_COMMENT.search(line):
            found.append((where, node.lineno, f"{where}:{node.lineno} {module}.{name}"))
    return [text for *_, text in sorted(found)], unparsed


def scan(source: str, where: str, newer: dict[str, list[str]]) -> list[str]:
    """``scan_units`` for one file."""
    found, unparsed = scan_units([(where, source)], newer)
    if unparsed:
        raise SyntaxError(f"{where} does not parse")
    return found


def _units():
    """Lists of (where, source) sharing a namespace: each .py file, each notebook's code cells."""
    for folder in ("src", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "_compat" not in rel:
                yield [(rel, path.read_text(encoding="utf-8"))]
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        rel = path.relative_to(ROOT).as_posix()
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        units = []
        for number, cell in enumerate(cells, 1):
            if cell.get("cell_type") != "code":
                continue
            source = cell["source"]
            source = "".join(source) if isinstance(source, list) else source
            # magics and shell lines blanked, so that line numbers stay the cell's own
            units.append((f"{rel} cell {number} line", "\n".join(
                "" if line.lstrip().startswith(("%", "!")) else line
                for line in source.splitlines()
            )))
        yield units


def test_no_torch_name_newer_than_the_floor():
    found, unparsed = [], []
    for units in _units():
        more, bad = scan_units(units, MANIFEST["modules"])
        found += more
        unparsed += bad  # a cell that is not Python even without its magics
    assert not found, (
        f"names that torch {MANIFEST['newest_checked']} has and torch {MANIFEST['floor']}"
        f" (the course's floor, pyproject.toml) lacks:\n  " + "\n  ".join(found) + "\n"
        "Use the floor's name, or add a fallback (getattr(module, 'name', fallback), a"
        " *_compat* module, or try/except ImportError), or mark a line meant for the newest"
        " torch only with '# torch>=2.13 only: <reason>'. The list: tests/torch_floor.json."
    )
    assert len(unparsed) < 5, f"cells the scan cannot parse: {unparsed}"


def test_the_manifest_has_the_known_breakages():
    newer = MANIFEST["modules"]
    for name in ("reduce_scatter_single", "all_gather_single"):
        assert name in newer["torch.distributed"]
        assert name in newer["torch.distributed.distributed_c10d"]
    assert "_DEFAULT_BUCKET_CAP_MB" in newer["torch.nn.parallel.distributed"]


def test_the_scan_finds_newer_names_and_spares_the_floors():
    newer = MANIFEST["modules"]
    bad = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed import all_gather_single\n"
        "from torch import distributed\n"
        "from torch.nn.parallel import distributed as ddp_mod\n"
        "def step(out, x):\n"
        "    dist.reduce_scatter_single(out, x)\n"
        "    torch.distributed.distributed_c10d.all_gather_single(out, x)\n"
        "    distributed.reduce_scatter_single(out, x)\n"
        "    return ddp_mod._DEFAULT_BUCKET_CAP_MB\n"
    )
    assert scan(bad, "bad.py", newer) == [
        "bad.py:3 torch.distributed.all_gather_single",
        "bad.py:7 torch.distributed.reduce_scatter_single",
        "bad.py:8 torch.distributed.distributed_c10d.all_gather_single",
        "bad.py:9 torch.distributed.reduce_scatter_single",
        "bad.py:10 torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB",
    ]
    good = (
        "import torch.distributed as dist\n"
        "from torch.nn.parallel import distributed as ddp_mod\n"
        "NEWER = ('reduce_scatter_single', 'all_gather_single')  # strings are fine\n"
        "def step(out, x):\n"
        "    dist.reduce_scatter_tensor(out, x)\n"
        "    rs = getattr(dist, 'reduce_scatter_single', None)\n"
        "    if hasattr(dist, 'all_gather_single'):\n"
        "        dist.all_gather_single(out, x)  # torch>=2.13 only: hasattr above\n"
        "    try:\n"
        "        from torch.distributed import all_gather_single\n"
        "    except ImportError:\n"
        "        all_gather_single = None\n"
        "    return rs, all_gather_single, getattr(ddp_mod, '_DEFAULT_BUCKET_CAP_MB', 25)\n"
    )
    assert scan(good, "good.py", newer) == []
