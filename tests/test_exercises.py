"""The exercise framework: checks and the student edition (grading: tests/test_grading*.py)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import nbformat
import pytest
import torch

from dpcourse.harness.exercises import check, core, registry, run_check
from dpcourse.harness.exercises.core import Mismatch, call_learner, expect_close
from dpcourse.harness.exercises.student import (
    make_student_edition,
    solution_lines,
    strip_solution_code,
    strip_solution_directives,
)
from dpcourse.one_device import memory

ROOT = Path(__file__).resolve().parents[1]


# -------------------------------------------------------------------------------- core helpers
def test_expect_close_names_what_differs_and_where():
    want = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    expect_close(want.clone(), want, "g")
    with pytest.raises(
        Mismatch, match=r"g: 1 of 4 values differ.*index \(1, 0\).*expected 3.*got 6.*= 2"
    ):
        expect_close(torch.tensor([[1.0, 2.0], [6.0, 4.0]]), want, "g")
    with pytest.raises(Mismatch, match=r"expected shape \(2, 2\), got shape \(4,\)"):
        expect_close(want.reshape(-1), want, "g")
    with pytest.raises(Mismatch, match="expected dtype torch.float32, got torch.float64"):
        expect_close(want.double(), want, "g")
    with pytest.raises(Mismatch, match="expected a tensor, got list"):
        expect_close([1, 2], want, "g")


def test_call_learner_turns_errors_into_messages_and_protects_inputs():
    def mutates_and_fails(t):
        t.zero_()
        return [][1]

    x = torch.ones(3)
    with pytest.raises(Mismatch, match=r"raised IndexError.*line \d+.*tensor of shape \(3,\)"):
        call_learner(mutates_and_fails, x)
    assert torch.equal(x, torch.ones(3))


def test_a_check_that_never_ends_times_out(monkeypatch):
    ex = registry()["ex-1-max-batch"]
    monkeypatch.setitem(core._registry, ex.label, core.Exercise(**{**ex.__dict__, "timeout": 1}))

    def forever(*args):
        while True:
            pass

    result = run_check(ex.label, forever)
    assert result.status == "failed" and "timed out" in result.message


def test_stub_is_not_attempted_and_check_shows_result(capsys):
    def stub(*args):
        raise NotImplementedError("Exercise ex-1-max-batch: write your solution here")

    assert run_check("ex-1-max-batch", stub).status == "not attempted"
    check.max_batch_size(stub)  # never raises in a learner's notebook
    assert "not attempted" in capsys.readouterr().out


def test_strict_mode_raises_on_a_failed_check(monkeypatch):
    monkeypatch.setenv(core.STRICT_ENV, "1")
    with pytest.raises(core.ExerciseFailed, match="ex-1-max-batch"):
        check.max_batch_size(lambda *a: 0)
    check.max_batch_size(memory.max_batch_size)  # the reference passes


def test_unknown_check_lists_the_real_ones():
    with pytest.raises(AttributeError, match="max_batch_size"):
        check.no_such_check  # noqa: B018


# ------------------------------------------------------------------------------ chapter 1
def test_max_batch_size_check_passes_reference_and_fails_wrong_answers():
    assert run_check("ex-1-max-batch", memory.max_batch_size).passed

    def forgets_fixed_part(model, sample, budget, optimizer="adam"):
        return budget // memory.estimate_training_memory(model, sample, optimizer).activations

    def off_by_one(model, sample, budget, optimizer="adam"):
        return memory.max_batch_size(model, sample, budget, optimizer) + 1

    def negative_when_nothing_fits(model, sample, budget, optimizer="adam"):
        one = memory.estimate_training_memory(model, sample, optimizer)
        fixed = one.parameters + one.gradients + one.optimizer_state
        return (budget - fixed) // one.activations

    for wrong, expected in [
        (forgets_fixed_part, r"expected 0, got \d+ \(an estimate at batch \d+ needs"),
        (off_by_one, r"expected (\d+), got \d+ \(an estimate at batch"),
        (negative_when_nothing_fits, r"expected 0, got -1"),
    ]:
        result = run_check("ex-1-max-batch", wrong)
        assert result.status == "failed"
        assert re.search(expected, result.message), result.message
        assert "MLP(hidden=" in result.message and "budget of" in result.message


def test_batch_growth_check():
    right = {"parameters": 1, "gradients": 1, "optimizer_state": 1, "activations": 2}
    assert run_check("ex-1-batch", lambda: right).passed
    result = run_check("ex-1-batch", lambda: {**right, "optimizer_state": 2})
    assert not result.passed and "optimizer_state" in result.message and "1.00" in result.message
    result = run_check("ex-1-batch", lambda: {**right, "activations": 1})
    assert not result.passed and "activations" in result.message and "2.00" in result.message
    result = run_check("ex-1-batch", lambda: {"parameters": 1})
    assert not result.passed and "keys" in result.message


def test_every_exercise_label_is_used_in_a_chapter_with_a_check_cell():
    texts = {p: p.read_text() for p in (ROOT / "chapters").glob("*.ipynb")}
    for ex in registry().values():
        holders = [p for p, t in texts.items() if f":label: {ex.label}" in t]
        assert holders, f"{ex.label} has a check but no exercise in any chapter"
        assert f"check.{ex.name}({ex.function}" in texts[holders[0]], ex.label


def test_a_learner_can_run_a_chapter_before_doing_its_exercises():
    """In the student edition a learner's function raises NotImplementedError until it is
    written; a cell other than its solution and its check that calls it would stop "Run all" at
    that cell. (The find-the-bugs page had one: it used my_noam_lambda to show the fix.)"""
    functions = {ex.function for ex in registry().values()}
    offending = []
    for path in sorted((ROOT / "chapters").glob("*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "code" or "solution" in cell.metadata.get("tags", []):
                continue
            named = sorted(f for f in functions if re.search(rf"\b{f}\b", cell.source))
            if named and not re.fullmatch(r"\s*check\.\w+\(\w+\)\s*", cell.source):
                offending.append(f"{path.name} cell {i}: {', '.join(named)}")
    assert not offending, "cells that need a learner's solution to run:\n  " + "\n  ".join(
        offending
    )


# --------------------------------------------------------------------------- student edition
def test_strip_solution_directives_handles_every_fence():
    text = textwrap.dedent("""\
        Keep this.

        ```{solution} ex-1-a
        :class: dropdown
        SECRET ONE
        ```

        ````{solution} ex-1-b
        ```python
        SECRET TWO
        ```
        ````

        :::{solution} ex-1-c
        SECRET THREE
        :::
        And keep this.
        """)
    out = strip_solution_directives(text)
    assert "SECRET" not in out and "Keep this." in out and "And keep this." in out


def test_strip_solution_code_keeps_the_signature():
    src = "def f(x):\n    '''doc'''\n    # BEGIN SOLUTION\n    return x + 1\n    # END SOLUTION\n"
    out = strip_solution_code(src, "ex-3-chunk")
    assert "return x + 1" not in out and out.startswith("def f(x):")
    # the stub names the exercise as its heading does (ex-3-chunk is Exercise 3.1)
    assert 'raise NotImplementedError("Exercise 3.1: write your solution here")' in out
    with pytest.raises(ValueError, match="without"):
        strip_solution_code("# BEGIN SOLUTION\nx = 1\n")


def test_student_notebooks_contain_no_solution(tmp_path):
    secrets = solution_lines(ROOT)
    assert len(secrets) > 10  # the test looks for something
    notebooks = make_student_edition(ROOT, tmp_path / "student")
    assert {p.name for p in notebooks} == {p.name for p in (ROOT / "chapters").glob("*.ipynb")}
    for nb_path in notebooks:
        text = nb_path.read_text()
        leaked = [s for s in secrets if s in text]
        assert not leaked, f"{nb_path.name} leaks: {leaked[:3]}"
        nb = nbformat.read(nb_path, as_version=4)
        nbformat.validate(nb)
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    config = (tmp_path / "student" / "_config.yml").read_text()
    assert "hide_solutions: true" in config and "(student edition)" in config
