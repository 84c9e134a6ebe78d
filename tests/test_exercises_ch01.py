"""Chapter 1's checks against the wrong answers students write (issue 43): an argument left at
its default, a dtype other than float32, a float where a batch size is asked, and an answer of
the wrong type, which must get a message, never a failure inside the check. The references (the
package's and the notebook's) pass; tests/test_exercises.py has the first wrong answers."""

from __future__ import annotations

import json
from pathlib import Path

from dpcourse.harness.exercises import run_check
from dpcourse.one_device import memory

ROOT = Path(__file__).resolve().parents[1]


def notebook_solutions() -> dict:
    """The functions chapter 1's solution cells define."""
    nb = json.loads((ROOT / "chapters" / "01_single_device.ipynb").read_text())
    namespace = {"memory": memory}
    for cell in nb["cells"]:
        if "solution" in cell.get("metadata", {}).get("tags", []):
            exec("".join(cell["source"]), namespace)
    return namespace


def expect_fail(label: str, fn, *phrases: str) -> None:
    result = run_check(label, fn)
    assert result.status == "failed", result.text()
    for phrase in phrases:
        assert phrase in result.message, f"{phrase!r} not in: {result.message}"


def test_the_references_pass():
    solutions = notebook_solutions()
    assert run_check("ex-1-max-batch", memory.max_batch_size).passed
    assert run_check("ex-1-max-batch", solutions["my_max_batch_size"]).passed
    assert run_check("ex-1-batch", solutions["growth_when_batch_doubles"]).passed


def _estimate(model, sample, optimizer):
    one = memory.estimate_training_memory(model, sample, optimizer)
    return one.parameters + one.gradients + one.optimizer_state, one.activations


def always_adam(model, sample, gpu_memory_bytes, optimizer="adam"):
    """Kind 1, a default never varied: the optimizer it is given is not passed on."""
    fixed, per_sample = _estimate(model, sample, "adam")
    return max(0, (gpu_memory_bytes - fixed) // per_sample)


def sgd_by_default(model, sample, gpu_memory_bytes, optimizer="sgd"):
    """Kind 1: the default differs from the statement's ("adam")."""
    fixed, per_sample = _estimate(model, sample, optimizer)
    return max(0, (gpu_memory_bytes - fixed) // per_sample)


def four_bytes_a_parameter(model, sample, gpu_memory_bytes, optimizer="adam"):
    """Kind 1, float32 only: 4 bytes per value of the weights, gradients and optimizer state,
    whatever the dtype."""
    _, per_sample = _estimate(model, sample, optimizer)
    params = sum(p.numel() for p in model.parameters())
    states = memory.OPTIMIZER_STATES[optimizer]
    fixed = 4 * (2 + states) * params
    if optimizer in ("adam", "adamw"):
        fixed += memory.ADAM_STEP_BYTES * len(list(model.parameters()))
    return max(0, (gpu_memory_bytes - fixed) // per_sample)


def true_division(model, sample, gpu_memory_bytes, optimizer="adam"):
    """A batch size that is a float."""
    fixed, per_sample = _estimate(model, sample, optimizer)
    return max(0, (gpu_memory_bytes - fixed) / per_sample)


def test_max_batch_size_rejects_what_students_write():
    expect_fail("ex-1-max-batch", always_adam, "optimizer='sgd'", "That is the answer for Adam",
                "pass `optimizer` on")
    expect_fail("ex-1-max-batch", sgd_by_default, "the default optimizer")
    expect_fail("ex-1-max-batch", four_bytes_a_parameter, "in float64")
    expect_fail("ex-1-max-batch", true_division, "expected int, got float", "use //")


def test_batch_growth_says_what_is_wrong_with_an_answer_of_another_type():
    expect_fail("ex-1-batch", lambda: (1, 1, 1, 2), "expected a dict with the keys")
    expect_fail("ex-1-batch", lambda: None, "expected a dict with the keys")
    right = {"parameters": 1, "gradients": 1, "optimizer_state": 1, "activations": 2}
    expect_fail("ex-1-batch", lambda: {**right, "activations": "x2"}, "the factor of activations",
                "expected int or float, got str")
