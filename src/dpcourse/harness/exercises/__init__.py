"""Exercises: checks a learner runs in the notebook, the student edition, and grading.

How an exercise is written in a chapter notebook (chapter 1 is the model to copy):

1. A markdown cell with the statement, as a sphinx-exercise directive labelled
   ``ex-<chapter>-<slug>`` (on the appendix pages ``ex-lab-<slug>`` and ``ex-bugs-<slug>``);
   the solution in a markdown cell of its own (``{solution} ex-<chapter>-<slug>`` with
   ``:class: dropdown``, so the website folds it). The exercise's number ("Exercise 5.2") comes
   from its place on the page (:mod:`~dpcourse.harness.exercises.numbering`): after adding,
   moving or removing one, run ``python -m dpcourse.harness.exercises numbers --write``.
2. For a coding exercise, a code cell tagged ``solution`` and ``hide-input`` where the
   learner's function has a fixed name and the reference code sits between marker lines::

       def my_chunk_data(batch, n):
           # BEGIN SOLUTION
           ...
           # END SOLUTION

   The student edition replaces the lines between the markers with
   ``raise NotImplementedError(...)`` and drops the solution directives; the full website shows
   that starter code and the check, and moves the reference code and what its check printed
   into the solution's fold (``_ext/exercise_pages.py``).
3. A check cell: ``check.chunk_data(my_chunk_data)``. The check lives in
   ``dpcourse/harness/exercises/chNN.py`` (the diagnosis lab's: ``lab.py``, labels
   ``ex-lab-<slug>``; find the bugs: ``bug_hunt.py``, ``ex-bugs-<slug>``), registered with
   :func:`~dpcourse.harness.exercises.core.exercise`; it passes the package's reference and fails
   wrong answers with a specific message.

Commands (``python -m dpcourse.harness.exercises --help``): ``student`` writes the student edition
of the book's sources, ``grade`` grades submitted notebooks (scores, totals and feedback per
student: :mod:`~dpcourse.harness.exercises.grading`), ``autograder`` writes a Gradescope
autograder, ``numbers --write`` writes the exercises' numbers from the pages.

Chapter 0: the exercise checks of the whole course.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from dpcourse.harness.exercises.core import (
    CheckResult,
    Mismatch,
    call_learner,
    check,
    exercise,
    expect_close,
    expect_equal,
    registry,
    run_check,
    run_learner_on_ranks,
)

__all__ = [
    "check",
    "exercise",
    "Mismatch",
    "CheckResult",
    "call_learner",
    "run_learner_on_ranks",
    "expect_close",
    "expect_equal",
    "registry",
    "run_check",
    "load_all",
]


@functools.cache
def load_all() -> None:
    """Import every chapter's check module (``chNN.py``) and the appendices' diagnosis lab
    (``lab.py``, labels ``ex-lab-...``) and "find the bugs" (``bug_hunt.py``, ``ex-bugs-...``)
    so that their checks are registered."""
    for info in pkgutil.iter_modules(__path__):
        if (info.name.startswith("ch") and info.name[2:].isdigit()) or info.name in (
            "lab",
            "bug_hunt",
        ):
            importlib.import_module(f"{__name__}.{info.name}")
