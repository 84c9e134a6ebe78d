"""What a submitted notebook's code defines and uses, read without running it: the statements an
exercise's function needs, the cells as a learner sees them, and the course's own functions an
answer names.

The grader runs an exercise's function with only what it needs (:meth:`Notebook.needed`): the
top-level statements that bind the names it reads (its ``def``, the imports, the helpers and
values it uses, and theirs in turn), and the statements that change those values in place
(``x.append(...)``, ``x[i] = ...``), in the notebook's order. The chapter's own measurements,
benchmarks and assertions, and whatever else the notebook does, are not run: they can neither
fail a learner's exercise nor change what the check sees. A name the function reaches only
through ``globals()``, ``eval`` or a ``global`` statement inside another function is not seen.

Cells are named as Jupyter shows them (:meth:`CodeCell.describe`): ``In [12]`` where the notebook
was saved after running, the exercise it sits under, and its first line.

Chapter 0: the exercise checks of the whole course (grading).
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import symtable
from dataclasses import dataclass, field
from typing import Any

from dpcourse.harness.exercises.numbering import number_of

__all__ = ["CodeCell", "Statement", "Notebook", "course_callables"]

_LABEL = re.compile(r":label:\s*(ex-[\w-]+)")
# The course's lesson code: what an exercise rebuilds. dpcourse.harness (the launcher, the checks,
# the grader) is the machinery, which no exercise asks for.
COURSE_PACKAGE = "dpcourse."
MACHINERY = "dpcourse.harness"


@dataclass
class CodeCell:
    """A code cell of the submitted notebook."""

    index: int  # its place among all the notebook's cells, from 0
    execution_count: int | None  # as saved: Jupyter's "In [n]"
    exercise: str | None  # the label of the exercise whose section it sits in
    source: str  # as Python (IPython's %magics and !commands turned into calls)
    problem: str | None = None  # why it cannot be read as Python, if it cannot

    filename: str = ""  # what its code is compiled as, which tracebacks show: <cell In [12]>

    def short_name(self) -> str:
        """``cell In [12]``, ``cell under Exercise 7.1`` or ``cell "import torch"``."""
        if self.execution_count is not None:
            return f"cell In [{self.execution_count}]"
        if self.exercise:
            return f"cell under Exercise {number_of(self.exercise) or self.exercise}"
        first = next((line.strip() for line in self.source.splitlines() if line.strip()), "")
        return f'cell "{first[:30]}"'

    def describe(self) -> str:
        """The cell as the learner sees it: ``cell In [12] under Exercise 7.1, which begins
        "def my_bucket_assignment(param_bytes, cap_bytes):"``."""
        first = next((line.strip() for line in self.source.splitlines() if line.strip()), "")
        if len(first) > 60:
            first = first[:57] + "..."
        where = "the cell"
        if self.execution_count is not None:
            where += f" In [{self.execution_count}]"
        if self.exercise:
            where += f" under Exercise {number_of(self.exercise) or self.exercise}"
        return f'{where}, which begins "{first}"'


@dataclass(eq=False)
class Statement:
    """A top-level statement of a code cell and the global names it binds, reads and changes."""

    cell: CodeCell
    index: int  # its place in the cell's body
    node: ast.stmt
    binds: frozenset[str]
    reads: frozenset[str]
    changes: frozenset[str]  # names whose object it changes in place: x.append(...), x[i] = ...
    imports: dict[str, str] = field(default_factory=dict)  # bound name -> what it imports
    star_import: str | None = None  # the module of ``from X import *``


def _python_source(source: str) -> tuple[str, ast.Module | None, str | None]:
    """``source`` as Python (IPython syntax turned into calls), its tree, and why it is not
    Python, if it is not."""
    try:
        return source, ast.parse(source), None
    except SyntaxError as exc:
        first_error = exc
    except (ValueError, RecursionError, MemoryError) as exc:
        return source, None, f"{type(exc).__name__}: {exc}"
    try:
        # import here: optional
        from IPython.core.inputtransformer2 import TransformerManager  # noqa: PLC0415

        transformed = TransformerManager().transform_cell(source)
        return transformed, ast.parse(transformed), None
    except ImportError:
        pass
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        pass
    return source, None, f"SyntaxError: {first_error.msg} (line {first_error.lineno})"


def _root(node: ast.expr) -> str | None:
    """The name an attribute or subscript chain starts from: ``x`` for ``x.a[0].b``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _changes(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        func = node.value.func
        if isinstance(func, ast.Attribute):
            root = _root(func.value)
            return {root} if root else set()
        return set()
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    return {r for t in targets if isinstance(t, (ast.Attribute, ast.Subscript))
            if (r := _root(t))}


def _text(lines: list[bytes], node: ast.stmt) -> str:
    """The statement's own text, cut from its cell's ``lines`` (UTF-8, as the AST's offsets
    count), from its first decorator's line if it has any."""
    decorators = getattr(node, "decorator_list", [])
    first, col = (decorators[0].lineno, 0) if decorators else (node.lineno, node.col_offset)
    body = lines[first - 1:node.end_lineno]
    if len(body) == 1:
        return body[0][col:node.end_col_offset].decode()
    return b"".join([body[0][col:], *body[1:-1], body[-1][:node.end_col_offset]]).decode()


def _names(lines: list[bytes], node: ast.stmt) -> tuple[set[str], set[str]]:
    """(names the statement binds at top level, global names it reads when run or when what it
    defines is called), from Python's own symbol tables."""
    try:
        table = symtable.symtable(_text(lines, node), "<statement>", "exec")
    except (SyntaxError, UnicodeDecodeError):
        table = symtable.symtable(ast.unparse(node), "<statement>", "exec")
    binds, reads = set(), set()
    for s in table.get_symbols():
        if s.is_assigned() or s.is_imported():
            binds.add(s.get_name())
        if s.is_referenced():
            reads.add(s.get_name())
    stack = list(table.get_children())
    while stack:
        t = stack.pop()
        stack.extend(t.get_children())
        for s in t.get_symbols():
            if s.is_global():
                reads.add(s.get_name())
            if s.is_declared_global() and s.is_assigned():
                binds.add(s.get_name())  # ``global g; g = ...`` in a function: when it is called
    return binds, reads


def _imports(node: ast.stmt) -> tuple[dict[str, str], str | None]:
    found: dict[str, str] = {}
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.asname:
                found[a.asname] = a.name
            else:
                first = a.name.split(".")[0]
                found[first] = first
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        for a in node.names:
            if a.name == "*":
                return found, node.module
            found[a.asname or a.name] = f"{node.module}.{a.name}"
    return found, None


class Notebook:
    """A submitted notebook's code, read (never run): its code cells and their statements."""

    def __init__(self, nb: dict):
        self.cells: list[CodeCell] = []
        self.statements: list[Statement] = []
        label = None
        names: set[str] = set()
        for i, cell in enumerate(nb.get("cells", [])):
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else str(source)
            if cell.get("cell_type") == "markdown":
                labels = _LABEL.findall(source)
                label = labels[-1] if labels else label
                continue
            if cell.get("cell_type") != "code":
                continue
            count = cell.get("execution_count")
            python, tree, problem = _python_source(source)
            code = CodeCell(i, count if isinstance(count, int) else None, label, python, problem)
            name, k = code.short_name(), 1
            while f"<{name}>" in names:  # unique: the player keeps each cell's lines by it
                k += 1
                name = f"{code.short_name()} #{k}"
            code.filename = f"<{name}>"
            names.add(code.filename)
            self.cells.append(code)
            if tree is None:
                continue
            lines = [line.encode() for line in python.splitlines(True)]
            for j, node in enumerate(tree.body):
                try:
                    binds, reads = _names(lines, node)
                except (SyntaxError, ValueError, RecursionError, MemoryError):
                    continue  # ast.unparse gave what symtable cannot read: nothing to run
                imports, star = _imports(node)
                self.statements.append(
                    Statement(code, j, node, frozenset(binds), frozenset(reads),
                              frozenset(_changes(node)), imports, star))
        self._imported = {n for s in self.statements for n in s.imports}

    def needed(self, names: set[str]) -> list[Statement]:
        """The statements that define ``names`` and what those read, in the notebook's order:
        every statement that binds a needed name (a later one rebinds it, as running the cells
        in order would), every ``from X import *``, and every statement that changes a needed
        value in place (not a module's: ``torch.manual_seed(0)`` is not fetched for ``torch``)."""
        need, todo = set(names), list(names)
        chosen: set[int] = {k for k, s in enumerate(self.statements) if s.star_import}
        for k in list(chosen):
            todo.extend(self.statements[k].reads)
        while todo:
            name = todo.pop()
            for k, s in enumerate(self.statements):
                if k in chosen:
                    continue
                if name in s.binds or (name in s.changes and name not in self._imported):
                    chosen.add(k)
                    for r in s.reads - need:
                        need.add(r)
                        todo.append(r)
        return [self.statements[k] for k in sorted(chosen)]

    def cell_problems(self, statements: list[Statement], names: set[str]) -> list[str]:
        """Why a cell that could define ``names`` was not read (it is not Python)."""
        found = {n for s in statements for n in s.binds}
        out = []
        for c in self.cells:
            if c.problem and any(re.search(rf"\b{re.escape(n)}\b", c.source)
                                 for n in names - found):
                out.append(f"{c.describe()} is not Python: {c.problem}")
        return out


@functools.lru_cache(maxsize=4096)
def _resolve(path: str) -> Any:
    """The object at the dotted ``path`` under the course package, or None (never imports
    anything outside it)."""
    if not path.startswith(COURSE_PACKAGE) or path.startswith(MACHINERY):
        return None
    parts = path.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module of the course that fails to import: nothing to name
            return None
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def _is_course_code(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return (callable(obj) and module.startswith(COURSE_PACKAGE)
            and not module.startswith(MACHINERY))


def course_callables(statements: list[Statement], within: ast.AST | None = None
                     ) -> dict[str, Any]:
    """The course package's functions and classes that ``statements`` name (or, given
    ``within``, that expression), by their dotted path through the statements' own imports:
    ``dpcourse.ddp.buckets.bucket_assignment`` for ``buckets.bucket_assignment`` after
    ``from dpcourse.ddp import buckets``."""
    imports: dict[str, set[str]] = {}
    stars = [s.star_import for s in statements if s.star_import]
    for s in statements:
        for name, target in s.imports.items():
            imports.setdefault(name, set()).add(target)
    found: dict[str, Any] = {}
    for tree in [within] if within is not None else [s.node for s in statements]:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, base = [], node
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if not isinstance(base, ast.Name):
                    continue
                chain.reverse()
                for target in imports.get(base.id, ()):
                    for cut in range(len(chain), 0, -1):
                        path = ".".join([target, *chain[:cut]])
                        obj = _resolve(path)
                        if _is_course_code(obj):
                            found.setdefault(path, obj)
                            break
            elif isinstance(node, ast.Name):
                targets = imports.get(node.id, set()) or {f"{m}.{node.id}" for m in stars}
                for path in targets:
                    obj = _resolve(path)
                    if _is_course_code(obj):
                        found.setdefault(path, obj)
    return found
