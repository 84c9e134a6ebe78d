"""No answer makes a check fail inside its own code (issue 43's fourth kind): whatever a
learner's function returns or raises, every check answers "failed" with a message about the
answer, never "error" ("the check itself failed ... please report it") or a traceback from the
check's code. The exercise tests (tests/test_exercises_*.py) have the answers of the other
kinds, each next to the references that pass."""

from __future__ import annotations

import pytest

from dpcourse.harness.exercises import registry, run_check

# Checks that run the learner's function on ranks: a function that raises there restarts the
# ranks of the shared pools (seconds each), so they get the answers that return instead.
ON_RANKS = {"ex-5-tree-broadcast", "ex-6-ring", "ex-7-hook", "ex-7-average",
            "ex-7-bucketed-ddp", "ex-8-amp", "ex-8-syncbn", "ex-9-sharded-step", "ex-9-zero2"}


def returning(value):
    return lambda *args, **kwargs: value


def raising(*args, **kwargs):
    raise ValueError("a learner's bug")


JUNK = {
    "None": returning(None),
    "an object": returning(object()),
    "a string": returning("x"),
    "a float": returning(3.5),
    "a list of odd things": returning([1, "a", None]),
    "a dict": returning({"a": 1}),
    "a raise": raising,
}


def test_the_rank_checks_are_the_ones_listed_here():
    """Every check whose exercise runs on ranks is in ON_RANKS (their modules say so)."""
    for label in ON_RANKS:
        assert label in registry()


@pytest.mark.parametrize("label", list(registry()))
def test_no_answer_makes_a_check_fail_inside_itself(label):
    answers = ["None", "an object"] if label in ON_RANKS else list(JUNK)
    for name in answers:
        result = run_check(label, JUNK[name])
        assert result.status == "failed", f"{label} given a function returning {name}: " + (
            result.text())
        assert "Traceback" not in result.message or "/dpcourse/harness/" not in result.message, (
            result.message)
