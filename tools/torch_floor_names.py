"""Write tests/torch_floor.json: names the installed torch has that the floor torch lacks.

The course supports torch 2.11 (a GPU image's torch) to 2.13 (requirements.txt's CPU pin).
tests/test_torch_versions.py fails on any use, in the package, the tests or the notebooks, of a
name that this manifest lists for its module, so that code written against the newest torch
also runs on the floor. Run by hand, with the newest supported torch installed::

    .venv/bin/python tools/torch_floor_names.py --floor-site /tmp/t211/site --floor 2.11

``--floor-site`` is a folder holding the floor's ``torch/`` package sources. The floor's wheel
need not import (the one checked is a CUDA build without its CUDA libraries): its ``.py`` files
are read with ``ast`` and never run. To get it, or to regenerate with a newer floor::

    pip download torch==2.12.0 --no-deps -d /tmp/floorwheel   # any platform's wheel will do
    mkdir -p /tmp/t212/site && unzip -q /tmp/floorwheel/torch-2.12.0-*.whl \\
        'torch/*.py' 'torch/*.pyi' -d /tmp/t212/site
    .venv/bin/python tools/torch_floor_names.py --floor-site /tmp/t212/site --floor 2.12

then update ``torch>=...`` in pyproject.toml (tests/test_torch_versions.py checks the installed
torch against that range), run tests/test_torch_versions.py and commit the JSON with the tool's
summary. To raise the ceiling: install the new torch, rerun this with the same floor, and fix or
guard what the test then reports.

What counts as existing in the newest torch: ``dir(module)`` after importing it, plus a package's
submodules on disk (``pkgutil``), dunder names left out. The installed build is the CPU one, so a
name only a CUDA build binds is not seen here (a miss, never a false positive).

What counts as existing in the floor: every name bound at module level in the floor's source
(``def``, ``class``, assignments with targets, annotated assignments with a value, ``for`` and
``with`` targets, ``import``/``from ... import``, ``global`` names set in functions, entries of
``__all__``), including inside ``if``/``try``/``with``/``for`` blocks whatever their condition,
plus the package's submodules (files and folders). ``from X import *`` follows X: the floor's
source for torch modules (its ``__all__`` if it has one, else its public names), the floor's
``.pyi`` stub for a C extension module (``torch._C...``), and the running interpreter's module for
anything else (the standard library). Names that a module sets by ``setattr``/``globals()`` or
that another module patches onto it are invisible here; they show up as false positives, so read
the summary this prints before committing: a name that clearly exists in both versions means the
analysis missed something, and a module whose diff cannot be made reliable goes into
``NOT_CHECKED`` below (listed in the JSON with the reason) instead of listing false positives.

Checked on torch 2.13.0+cpu against the 2.11.0 wheel's sources (2.11.0+cu130): every module of
MODULES is analysed and its diff read by eye (none needed dropping; the names found, e.g.
``Any``/``Callable`` in device_mesh or ``itertools`` in utils.checkpoint, really are not bound in
2.11's module). torch.cuda, which pulls names from torch._C, comes out without
false positives because its C names are imported by name in its source (``from torch._C import
...``); its ``from .memory import *`` and ``from .random import *`` are followed in the floor's
sources.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import pkgutil
import sys
from pathlib import Path

import torch

MODULES = [
    "torch.distributed",
    "torch.distributed.distributed_c10d",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.algorithms.join",
    "torch.distributed.optim",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.nn.parallel.distributed",
    "torch.nn.parallel",
    "torch.amp",
    "torch.cuda.amp",
    "torch.optim",
    "torch.optim.lr_scheduler",
    "torch.nn.utils",
    "torch.testing",
    "torch.utils.data",
    "torch.utils.checkpoint",
    "torch.autograd.graph",
    "torch.overrides",
    "torch.cuda",
    "torch.profiler",
]

# module -> why its diff is not reliable (kept out of the manifest's "modules"). Empty for 2.11.
NOT_CHECKED: dict[str, str] = {}

OUT = Path(__file__).resolve().parent.parent / "tests" / "torch_floor.json"


class FloorSource:
    """Module-level names of the floor's torch, read statically from its sources."""

    def __init__(self, site: Path):
        self.site = site
        self._cache: dict[str, set[str]] = {}
        self._all_cache: dict[str, list[str] | None] = {}

    def path(self, module: str) -> Path | None:
        base = self.site.joinpath(*module.split("."))
        for candidate in (base / "__init__.py", base.with_suffix(".py"), base.with_suffix(".pyi"),
                          base / "__init__.pyi"):
            if candidate.is_file():
                return candidate
        return None

    def _tree(self, module: str) -> tuple[ast.Module, Path] | None:
        path = self.path(module)
        if path is None:
            return None
        return ast.parse(path.read_text(encoding="utf-8"), str(path)), path

    def defined(self, module: str) -> set[str]:
        """Every name bound at module level in the floor's ``module`` (and its submodules)."""
        if module in self._cache:
            return self._cache[module]
        self._cache[module] = set()  # a cycle of star imports ends here
        parsed = self._tree(module)
        if parsed is None:
            raise FileNotFoundError(f"{module}: no source under {self.site}")
        tree, path = parsed
        is_package = path.stem == "__init__"
        package = module if is_package else module.rpartition(".")[0]
        names: set[str] = set()
        if is_package:
            for child in path.parent.iterdir():
                if child.suffix in (".py", ".pyi") and child.stem != "__init__":
                    names.add(child.stem)
                elif child.is_dir() and child.name.isidentifier():
                    names.add(child.name)
        self._collect(tree.body, package, names, stub=path.suffix == ".pyi")
        names.update(self.dunder_all(module) or [])
        self._cache[module] = names
        return names

    def dunder_all(self, module: str) -> list[str] | None:
        """The floor's ``__all__`` of ``module`` if a literal list (``+=`` too), else None."""
        if module in self._all_cache:
            return self._all_cache[module]
        self._all_cache[module] = None
        parsed = self._tree(module)
        if parsed is None:
            return None
        found: list[str] | None = None
        for node in ast.walk(parsed[0]):
            target, value = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                target, value = node.target, node.value
            if not (isinstance(target, ast.Name) and target.id == "__all__"):
                continue
            if isinstance(value, (ast.List, ast.Tuple)):
                strings = [e.value for e in value.elts
                           if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                found = (found or []) + strings if isinstance(node, ast.AugAssign) else strings
        self._all_cache[module] = found
        return found

    def star(self, module: str) -> set[str]:
        """What ``from module import *`` binds, in the floor."""
        if module == "torch" or module.startswith("torch."):
            if self.path(module) is None:
                raise FileNotFoundError(f"from {module} import *: no source or stub in the floor")
            exported = self.dunder_all(module)
            if exported is not None:
                return set(exported)
            return {n for n in self.defined(module) if not n.startswith("_")}
        mod = importlib.import_module(module)  # the standard library: the same in both
        return set(getattr(mod, "__all__", [n for n in dir(mod) if not n.startswith("_")]))

    def _resolve(self, node: ast.ImportFrom, package: str) -> str:
        if not node.level:
            return node.module or ""
        base = package.split(".")
        if node.level > 1:
            base = base[: -(node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _collect(self, body: list[ast.stmt], package: str, names: set[str], stub: bool) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                if not isinstance(node, ast.ClassDef):
                    for inner in ast.walk(node):  # `global X` then `X = ...` in a function
                        if isinstance(inner, ast.Global):
                            names.update(inner.names)
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    names.add(alias.asname or alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                source = self._resolve(node, package)
                for alias in node.names:
                    if alias.name == "*":
                        names.update(self.star(source))
                    else:
                        names.add(alias.asname or alias.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(_bound(target))
            elif isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor)):
                names.update(_bound(node.target))
            elif isinstance(node, ast.AnnAssign):
                if node.value is not None or stub:
                    names.update(_bound(node.target))
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        names.update(_bound(item.optional_vars))
            elif hasattr(ast, "TypeAlias") and isinstance(node, ast.TypeAlias):
                names.update(_bound(node.name))
            for inner in ast.walk(node):  # walrus anywhere in a module-level statement
                if isinstance(inner, ast.NamedExpr):
                    names.update(_bound(inner.target))
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    self._collect(block, package, names, stub)
            for handler in getattr(node, "handlers", []):
                self._collect(handler.body, package, names, stub)
            for case in getattr(node, "cases", []):
                self._collect(case.body, package, names, stub)


def _bound(target: ast.expr) -> set[str]:
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_bound(e) for e in target.elts)) if target.elts else set()
    if isinstance(target, ast.Starred):
        return _bound(target.value)
    return set()  # attribute or subscript targets bind nothing in the module


def newer_names(module: str, floor: FloorSource) -> list[str]:
    mod = importlib.import_module(module)
    old = floor.defined(module)
    present = set(dir(mod))
    # a package's submodules count even where nothing imported them yet
    present.update(info.name for info in pkgutil.iter_modules(getattr(mod, "__path__", [])))
    return sorted(n for n in present if not (n.startswith("__") and n.endswith("__"))
                  and n not in old)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floor-site", type=Path, required=True,
                        help="folder holding the floor torch's torch/ sources")
    parser.add_argument("--floor", required=True, help="the floor version, e.g. 2.11")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    floor = FloorSource(args.floor_site)
    modules: dict[str, list[str]] = {}
    for module in MODULES:
        if module in NOT_CHECKED:
            continue
        modules[module] = newer_names(module, floor)
        shown = ", ".join(n for n in modules[module] if not n.startswith("_")) or "-"
        print(f"{module}: {len(modules[module])} ({shown})")
    manifest: dict[str, object] = {
        "floor": args.floor,
        "newest_checked": torch.__version__.split("+")[0],
        "modules": modules,
    }
    if NOT_CHECKED:
        manifest["not_checked"] = NOT_CHECKED
    args.out.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
