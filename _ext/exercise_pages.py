"""The exercises as a learner meets them on the website (issue 34, items 2 and 3).

Loaded by `_config.yml` (`sphinx: local_extensions`). Three things:

* **Numbers.** sphinx-exercise numbers exercises across the whole book (chapter 5's first was
  "Exercise 16"). Here each page's exercises are numbered `<part>.<k>` as
  `dpcourse.harness.exercises.numbering` says ("Exercise 5.1", "Exercise Lab.2"), in the
  headings, the solutions' titles and every `{numref}` to an exercise, so that they say what the
  checks' messages say. A number that differs from the package's table
  (`exercise_numbers.py`, written from the pages) is a warning, an error under `-W`.
* **Starter code first.** In the sources a coding exercise is its statement, a cell of reference
  code (tagged `solution`, the answer between `# BEGIN SOLUTION` and `# END SOLUTION`), a check
  cell and a folded `{solution}`. Shown as it is, the first fold a reader opens under the
  question is the answer, and the check's output under it says "passed" with what was right.
  Here the reference cell shows the starter code instead (what the student edition hands out:
  the body replaced by `raise NotImplementedError`), the check cell shows its call without its
  output, and the reference code and what its check printed move into the `{solution}`'s fold,
  after the explanation. The student edition has no markers left, so nothing moves there.
* **`{check-example}`**: the instructor guide shows what a failed check prints by running the
  check on the wrong answer written in the directive's body, when the book is built.
"""

from __future__ import annotations

import re
import textwrap

from docutils import nodes
from docutils.parsers.rst import Directive
from sphinx.util import logging

from dpcourse.harness.exercises import numbering, registry, run_check
from dpcourse.harness.exercises.student import BEGIN, END, strip_solution_code

logger = logging.getLogger(__name__)

CHECK_CALL = re.compile(r"^\s*check\.(?P<name>\w+)\((?P<fn>\w+)\)\s*$")
DEFINED = re.compile(r"^def (\w+)\(", re.M)


def fold_intro() -> nodes.paragraph:
    """The sentence that opens the reference code inside a solution's fold."""
    para = nodes.paragraph()
    para += nodes.Text("The reference solution (the code that replaces the starter's ")
    para += nodes.literal("raise NotImplementedError", "raise NotImplementedError")
    para += nodes.Text(") and what its check printed:")
    return para


# ----------------------------------------------------------------------------- numbers
def number_exercises(app, env):
    """Give each page's exercises the numbers `<part>.<k>` (runs after Sphinx has numbered
    them across the book, on the same event)."""
    for docname, by_type in env.toc_fignumbers.items():
        numbers = by_type.get("exercise")
        if not numbers:
            continue
        for k, label in enumerate(list(numbers), start=1):
            try:
                part, _ = numbering.parse_label(label)
            except ValueError as exc:
                logger.warning(f"{exc}", location=docname, type="exercise", subtype="number")
                continue
            number = f"{numbering.part_title(part)}.{k}"
            known = numbering.number_of(label)
            if known != number:
                logger.warning(
                    f"the exercise {label} is Exercise {number} on its page, but "
                    f"dpcourse.harness.exercises.exercise_numbers says {known or 'nothing'}: run "
                    "`python -m dpcourse.harness.exercises numbers --write`",
                    location=docname, type="exercise", subtype="number",
                )
            numbers[label] = (numbering.part_title(part), k)
    return []


# ----------------------------------------------------------------------------- layout
def _is_cell(node) -> bool:
    return isinstance(node, nodes.container) and node.get("nb_element") == "cell_code"


def _source_of(cell: nodes.Element) -> nodes.literal_block | None:
    return next(iter(cell.findall(nodes.literal_block)), None)


def _outputs_of(cell: nodes.Element) -> list[nodes.Element]:
    return [c for c in cell.children
            if isinstance(c, nodes.container) and c.get("nb_element") == "cell_code_output"]


def _with_source(block: nodes.literal_block, text: str) -> nodes.literal_block:
    new = block.deepcopy()
    new.rawsource = text
    new.children = []
    new += nodes.Text(text)
    return new


def _unfolded(cell: nodes.Element) -> nodes.Element:
    """The cell without myst-nb's fold (its hide-input/hide-cell tags)."""
    cell.attributes.pop("hide_mode", None)
    return cell


def _exercise_label(node) -> str | None:
    if node.__class__.__name__ != "exercise_enumerable_node":
        return None
    return node.get("label") or None


def starter_code_first(app, doctree):
    """Show each coding exercise's starter code and check, and fold the reference code and the
    check's output into its solution (see the module's docstring)."""
    solutions = {n["target_label"]: n for n in doctree.findall(
        lambda n: n.__class__.__name__ == "solution_node")}
    ordered = list(doctree.findall(lambda n: _is_cell(n) or _exercise_label(n) is not None))
    label = None
    for i, node in enumerate(ordered):
        if not _is_cell(node):
            label = _exercise_label(node)
            continue
        block = _source_of(node)
        tags = (node.get("cell_metadata") or {}).get("tags", [])
        if block is None or "solution" not in tags or BEGIN not in block.astext():
            continue
        source = block.astext()
        where = node.source or app.env.docname
        if label is None or label not in solutions:
            logger.warning(
                f"a cell of reference code ({BEGIN}) with no {{solution}} of "
                f"{label or 'an exercise'} after it to fold it into",
                location=(where, node.line), type="exercise", subtype="layout")
            continue
        defined = set(DEFINED.findall(source))
        check = next((c for c in ordered[i + 1:] if _is_cell(c) and _source_of(c) is not None
                      and (m := CHECK_CALL.match(_source_of(c).astext()))
                      and m["fn"] in defined), None)
        reference = _unfolded(node.deepcopy())
        marker_free = "".join(line for line in source.splitlines(keepends=True)
                              if line.strip() not in (BEGIN, END))
        _source_of(reference).replace_self(_with_source(_source_of(reference), marker_free))
        reference["classes"].append("exercise-reference")
        # The starter: what the student edition hands out, unfolded, without outputs.
        block.replace_self(_with_source(block, strip_solution_code(source, label)))
        for out in _outputs_of(node):
            node.remove(out)
        _unfolded(node)["classes"].append("exercise-starter")
        fold = [fold_intro(), reference]
        if check is not None:
            shown = _unfolded(check.deepcopy())
            shown["classes"].append("exercise-reference")
            fold.append(shown)
            for out in _outputs_of(check):
                check.remove(out)
        body = next((c for c in solutions[label].children if isinstance(c, nodes.section)),
                    solutions[label])
        body.extend(fold)


# ----------------------------------------------------------------------------- {check-example}
class CheckExample(Directive):
    """```{check-example} ex-5-rounds
    def broadcast_rounds(world_size):  # the wrong answer: the function the check takes
        return world_size - 1
    ```
    shows that code, the check's call and what the check printed when the book was built.
    The answer must be wrong: a check that passes it is an error."""

    required_arguments = 1
    has_content = True

    def run(self):
        label = self.arguments[0]
        exercises = registry()
        if label not in exercises:
            raise self.error(f"no exercise with a check is labelled {label!r}")
        ex = exercises[label]
        code = textwrap.dedent("\n".join(self.content)).strip() + "\n"
        namespace: dict = {}
        exec(compile(code, f"<check-example {label}>", "exec"), namespace)  # the page's own code
        fn = namespace.get(ex.function or "")
        if not callable(fn):
            raise self.error(f"the example must define {ex.function}(), which check.{ex.name} "
                             "takes")
        result = run_check(label, fn)
        if result.passed:
            raise self.error(f"check.{ex.name} passed the example: show a wrong answer")
        call = f"check.{ex.name}({ex.function})\n"
        listing = nodes.literal_block(code + "\n" + call, code + "\n" + call, language="python")
        shown = nodes.raw("", result.html(), format="html")
        container = nodes.container(classes=["check-example"])
        container += [listing, shown]
        return [container]


def setup(app):
    app.connect("env-get-updated", number_exercises, priority=900)
    app.connect("doctree-read", starter_code_first)
    app.add_directive("check-example", CheckExample)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
