"""The diagnosis lab's checks: the right cause passes; plausible wrong causes fail, saying why."""

from __future__ import annotations

import pytest

from dpcourse.debugging import diagnosis
from dpcourse.harness.exercises import registry, run_check
from dpcourse.harness.exercises.core import Exercise


def answer(value):
    return lambda: value


def rejected(label: str, value, *phrases: str) -> str:
    result = run_check(label, answer(value))
    assert result.status == "failed", (value, result)
    for phrase in phrases:
        assert phrase in result.message, (phrase, result.message)
    return result.message


def test_the_lab_registers_four_checks_under_the_appendix_number():
    lab = {label: ex for label, ex in registry().items() if label.startswith("ex-11-")}
    assert set(lab) == {"ex-11-straggler", "ex-11-hang", "ex-11-buckets", "ex-11-bandwidth"}
    assert all(isinstance(ex, Exercise) and ex.chapter == 11 and ex.function for ex in lab.values())
    after_10 = [label for label, ex in registry().items() if ex.chapter > 10]
    assert after_10[:4] == sorted(lab)  # after chapter 10's (the find-the-bugs page's ex-12 next)


def test_straggler_check():
    right = {"cause": "straggler", "rank": diagnosis.STRAGGLER_RANK}
    assert run_check("ex-11-straggler", answer(right)).passed
    assert run_check("ex-11-straggler", answer({"cause": " Straggler ", "rank": 2})).passed
    rejected(
        "ex-11-straggler",
        {"cause": "slow network", "rank": 2},
        "'slow network'",
        "is not the cause",
        "one rank spends almost no time inside it",
    )
    rejected(
        "ex-11-straggler",
        {"cause": "shared cores", "rank": 2},
        "is not the cause",
        "the same rank takes tens of milliseconds longer",
    )
    rejected("ex-11-straggler", {"cause": "small buckets", "rank": 2}, "no small messages")
    rejected("ex-11-straggler", {"cause": "skipped collective", "rank": 2}, "waiting forever")
    rejected("ex-11-straggler", {"cause": "straggler", "rank": 0}, "one of the ranks that wait")
    rejected(
        "ex-11-straggler",
        {"cause": "GiB as GB", "rank": 2},
        "It does not fit what was measured",
        "one before the all-reduce, the others inside it",
    )


def test_hang_check():
    right = {"cause": "skipped collective", "rank": diagnosis.SKIPPING_RANK}
    assert run_check("ex-11-hang", answer(right)).passed
    rejected(
        "ex-11-hang",
        {"cause": "straggler", "rank": 1},
        "is not the cause",
        "arrives late, but it arrives",
    )
    rejected(
        "ex-11-hang",
        {"cause": "timeout too short", "rank": 1},
        "A longer timeout only waits longer",
        "5 minutes",
    )
    rejected("ex-11-hang", {"cause": "slow network", "rank": 1}, "was never sent")
    rejected("ex-11-hang", {"cause": "skipped collective", "rank": 0}, "stuck in the all-reduce")
    rejected("ex-11-hang", {"cause": "skipped collective", "rank": 2}, "missing from the report")


def test_buckets_check():
    assert run_check("ex-11-buckets", answer("small buckets")).passed
    rejected("ex-11-buckets", "slow network", "is not the cause", "the bytes move quickly")
    rejected("ex-11-buckets", "shared cores", "is not the cause", "not the cores")
    rejected("ex-11-buckets", "straggler", "same model on batches of the same size")
    rejected("ex-11-buckets", "timeout too short", "Nothing hung")


def test_bandwidth_check():
    right = {"A": "busbw as algbw", "B": "GiB as GB"}
    assert run_check("ex-11-bandwidth", answer(right)).passed
    assert run_check("ex-11-bandwidth", answer({"a": "BUSBW as algbw", "b": "gib as gb"})).passed
    swapped = rejected(
        "ex-11-bandwidth",
        {"A": "GiB as GB", "B": "busbw as algbw"},
        "Report A: 'GiB as GB'",
        "1.500 times the algbw",
        "would make it 0.931 times",
        "Report B: 'busbw as algbw'",
        "0.931 times the algbw",
        "would make it 2(N-1)/N = 1.500 times",
    )
    assert swapped.count("is not the cause") == 2
    rejected(
        "ex-11-bandwidth", {**right, "A": "bits as bytes"}, "Report A", "would make it 8 times"
    )
    message = rejected(
        "ex-11-bandwidth", {**right, "B": "warm-up timed"}, "Report B", "lengthen that time"
    )
    assert "Report A" not in message  # only the wrong report is named
    rejected("ex-11-bandwidth", {**right, "B": "straggler"}, "It does not fit what was measured")


@pytest.mark.parametrize(
    "label, value, phrase",
    [
        ("ex-11-straggler", "straggler", 'expected a dict {"cause": ..., "rank": ...}'),
        ("ex-11-straggler", {"cause": "straggler", "rank": 3}, "a rank from 0 to 2"),
        ("ex-11-hang", {"cause": "deadlock", "rank": 1}, "one of the keys of diagnosis.CAUSES"),
        ("ex-11-buckets", 3, "one of the keys of diagnosis.CAUSES"),
        ("ex-11-bandwidth", {"A": "GiB as GB"}, 'expected a dict {"A": ..., "B": ...}'),
    ],
)
def test_answers_of_the_wrong_form_say_what_is_expected(label, value, phrase):
    rejected(label, value, phrase)


def test_every_answer_is_a_cause_the_lab_lists():
    answers = {"straggler", "skipped collective", "small buckets", "busbw as algbw", "GiB as GB"}
    assert answers <= set(diagnosis.CAUSES)
